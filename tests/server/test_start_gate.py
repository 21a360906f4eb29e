"""`tokenweir serve --engine-process` listens while its engine core process builds
(tokenweir/server/gate.py): until the core is ready every request, GET /health included, gets
503 with the API's error shape; once it is, the real app answers. The core is held back with
SIGSTOP (the probe that it was not ready: frozen, it cannot have said so, and the server's
/health turns 200 only after SIGCONT). Also: the engine core builds its tokenizer only when
something needs it (model/deferred_tokenizer.py), and that tokenizer behaves as the eager one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from probes import API_KEY, HEADERS, MODEL, free_port, post, stop_server

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import forkserver  # noqa: E402  (tests/forkserver.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENWEIR_API_KEY": API_KEY,
           "NO_PROXY": "127.0.0.1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "tokenweir", "serve", MODEL, "--dtype", "float32",
           "--max-model-len", "1024", "--num-gpu-blocks-override", "512", "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "warning", "--engine-process"]
    return forkserver.popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _core_of(server: subprocess.Popen, seconds: float = 60) -> int:
    """The engine core's pid, found as soon as the server forks it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read().decode()[-3000:]
        with open(f"/proc/{server.pid}/task/{server.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        if children:
            return children[0]
        time.sleep(0.002)
    raise AssertionError("no engine core process")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _stop(pid: int) -> None:
    """SIGSTOP pid and wait until it is stopped (the signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _state(pid) != "T":
        assert time.monotonic() < deadline, "the engine core did not stop"
        time.sleep(0.001)


def _first_answer(base: str, path: str, seconds: float = 90) -> httpx.Response:
    """The first HTTP answer to GET path (connection refused until uvicorn listens)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return httpx.get(base + path, timeout=5, trust_env=False)
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError(f"the server did not answer {path} within {seconds} s")


def test_health_is_503_until_the_core_is_ready_then_200():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = _start(port)
    try:
        core = _core_of(server)
        _stop(core)  # probe: the core is frozen, so it cannot become ready
        first = _first_answer(base, "/health")
        assert first.status_code == 503, first.text
        assert first.json()["error"]["type"] == "service_unavailable"
        refused = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                 "max_tokens": 2})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and "starting" in error["message"]
        assert refused.headers["Retry-After"]
        time.sleep(1.0)
        assert httpx.get(base + "/health", timeout=5, trust_env=False).status_code == 503
        assert _state(core) == "T"  # still frozen: every 503 came before ready
        os.kill(core, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while httpx.get(base + "/health", timeout=5, trust_env=False).status_code != 200:
            assert time.monotonic() < deadline, "the gate never opened"
            time.sleep(0.05)
        reply = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                               "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
        unauthorised = httpx.get(base + "/v1/models", timeout=5, trust_env=False)
        assert unauthorised.status_code == 401  # the real app's middleware is in front now
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except (NameError, ProcessLookupError):
            pass
        stop_server(server)
    assert server.returncode == 0


def test_a_stop_before_ready_exits_0_and_ends_the_core():
    port = free_port()
    server = _start(port)
    core = _core_of(server)
    _stop(core)
    try:
        assert _first_answer(f"http://127.0.0.1:{port}", "/health").status_code == 503
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
    assert server.returncode == 0, server.stdout.read().decode()[-3000:]
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{core}") and _state(core) != "Z":
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cached_tokenizer_parts():
    """(backend JSON, fields) of the default model's tokenizer, as the load cache holds it."""
    from tokenweir.model.loader import open_gguf_cached
    from tokenweir.model.paths import resolve_model_path

    tokenizer = open_gguf_cached(resolve_model_path(MODEL))[2]
    return tokenizer.to_cache()


TEXTS = ["The capital of France is", " déjà vu, naïve — 東京 🙂", "<|im_start|>user\nHi"]


def test_a_deferred_tokenizer_builds_on_first_use_and_matches_the_eager_one(
        cached_tokenizer_parts):
    from tokenweir.guided.vocab import vocabulary_of
    from tokenweir.model.deferred_tokenizer import DeferredTokenizer
    from tokenweir.model.tokenizer import Tokenizer

    eager = Tokenizer.from_cache(*cached_tokenizer_parts)
    deferred = DeferredTokenizer(*cached_tokenizer_parts)
    assert deferred.eos_token_ids == eager.eos_token_ids
    assert deferred.to_cache() == cached_tokenizer_parts
    assert not deferred.built  # probe: reading EOS ids and the cache form built nothing
    for text in TEXTS:
        ids = eager.encode(text)
        assert deferred.encode(text) == ids and len(ids) > 2
        assert deferred.decode(ids) == eager.decode(ids)
    assert deferred.built
    messages = [{"role": "user", "content": "Say hi."}]
    assert deferred.apply_chat_template(messages) == eager.apply_chat_template(messages)
    ours, theirs = vocabulary_of(deferred, 49152), vocabulary_of(eager, 49152)
    assert ours.token_bytes == theirs.token_bytes and ours.stop_ids == theirs.stop_ids


def test_an_engine_core_builds_no_tokenizer_and_guides_as_the_eager_engine():
    """What the core process builds (LLMEngine(defer_tokenizer=True)): no tokenizer at start,
    and a guided request (the core's one use of it: the vocabulary) gets the same tokens."""
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm import LLM
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.model.deferred_tokenizer import DeferredTokenizer
    from tokenweir.request import GuidedDecodingParams, SamplingParams

    config = EngineConfig.from_kwargs(model=MODEL, dtype="float32", device="cpu",
                                      max_model_len=512, num_gpu_blocks_override=64)
    deferred = LLMEngine(config, defer_tokenizer=True)
    assert isinstance(deferred.tokenizer, DeferredTokenizer)  # probe: the load cache served
    assert not deferred.tokenizer.built
    assert deferred.eos_token_ids  # read from the cache's fields
    eager = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=12,
                            guided_decoding=GuidedDecodingParams(regex="[0-9]{3}-[0-9]{4}"))
    prompt = {"prompt_token_ids": eager.tokenizer.encode("Call me at")}
    answers = [LLM.from_engine(engine).generate([prompt], params)[0].outputs[0]
               for engine in (eager, deferred)]
    assert answers[0].token_ids == answers[1].token_ids
    assert answers[1].text and all(c.isdigit() or c == "-" for c in answers[1].text)
    assert deferred.tokenizer.built  # probe: built once needed (the vocabulary, the text)


def test_the_prompt_bound_is_listed_once_per_tokenizer_and_before_ready(cached_tokenizer_parts):
    """AsyncEngine's prompt bound (_longest_token_chars) is remembered per tokenizer, and
    RemoteEngine.connect computes it before it waits for the core's "ready"."""
    from tokenweir.engine import async_engine, core_client
    from tokenweir.model.tokenizer import Tokenizer

    class Counting:
        def __init__(self, backend):
            self.backend, self.listed = backend, 0

        def get_vocab(self, with_added_tokens=True):
            self.listed += 1
            return self.backend.get_vocab(with_added_tokens=with_added_tokens)

    tokenizer = Tokenizer.from_cache(*cached_tokenizer_parts)
    expected = max(16, max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True))))
    tokenizer.backend = counting = Counting(tokenizer.backend)
    assert async_engine._longest_token_chars(tokenizer) == expected
    assert async_engine._longest_token_chars(tokenizer) == expected
    assert counting.listed == 1  # probe: it was listed, once
    assert async_engine._longest_token_chars(None) == 256

    class NotReady:  # a client whose core never says "ready": connect stops at the wait
        def wait_ready(self):
            raise TimeoutError

    fresh = Tokenizer.from_cache(*cached_tokenizer_parts)
    real = core_client.cached_tokenizer
    core_client.cached_tokenizer = lambda model: fresh
    try:
        with pytest.raises(TimeoutError):
            core_client.RemoteEngine.connect(NotReady(), MODEL)
    finally:
        core_client.cached_tokenizer = real
    assert async_engine._LONGEST.get(fresh) == expected


def test_a_refusal_only_the_core_can_tell_stops_the_listening_server_with_status_2():
    """The core's build refuses (host memory too small for --swap-space, known only at the
    load): the server, already listening behind the gate, stops and says it in one line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "tokenweir", "serve", MODEL, "--dtype", "float32",
           "--max-model-len", "1024", "--num-gpu-blocks-override", "512", "--port",
           str(free_port()), "--log-level", "info", "--engine-process",
           "--preemption-mode", "swap", "--swap-space", "100000"]
    done = forkserver.run(cmd, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Started server process" in done.stderr  # probe: it was listening (the gate's path)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenweir serve: error: --swap-space") and "host memory" in last
