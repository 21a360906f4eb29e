"""The serving path's output thread (issue 12): the engine thread hands each step's raw
outputs to the output thread and goes straight to the next step. Checked in process, on a tiny
random-weight Llama through the real runner: the answers (tokens, text, stop strings, finish
reasons) are exactly the synchronous engine's; the engine thread finishes its steps while output
processing is held up (the probe: nothing was delivered meanwhile); a stop string, an abort and
a processing failure each end their request alone and free its blocks; the serving profile
accounts for the steps and tokens it saw."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams
from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.serving_profile import ServingProfile, format_profile
from tokenweir.faults import inject

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              num_gpu_blocks_override=80, max_num_batched_tokens=64)
NUM_PROMPTS = 5


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-output-thread")
    make_tiny_model("llama", str(path), seed=5)
    save_tiny_tokenizer(str(path), TEMPLATE)
    return str(path)


def _prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 360) for _ in range(rng.randint(8, 30))]}
            for _ in range(NUM_PROMPTS)]


def _params(stop: tuple[str, ...] = ()) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=list(stop))
            for _ in range(NUM_PROMPTS)]


def _offline(path: str, params: list[SamplingParams]) -> list:
    return LLM(path, **ENGINE).generate(_prompts(), params, use_tqdm=False)


def _serve(path: str, params: list[SamplingParams], output_thread: bool = True,
           profile=None, before=None, abort=None) -> tuple[AsyncEngine, list[dict]]:
    """Stream every prompt through an AsyncEngine; per request: joined text, tokens, the
    final chunk's finish reason / stop reason / error. `before(async_engine)` runs once the
    engine is started; `abort` names a request index aborted after its first chunk."""
    engine = AsyncEngine(LLM(path, **ENGINE).llm_engine, output_thread=output_thread,
                         profile=profile)

    async def one(i: int, prompt: dict, sp: SamplingParams) -> dict:
        got = {"text": "", "tokens": [], "chunks": 0}
        async for out in engine.generate(prompt, sp, request_id=f"r{i}"):
            got["text"] += out.outputs[0].text
            got["tokens"] += out.outputs[0].token_ids
            got["chunks"] += 1
            got.update(finish=out.outputs[0].finish_reason, stop=out.outputs[0].stop_reason,
                       error=out.error, finished=out.finished)
            if abort == i:
                break
        return got

    async def main() -> list[dict]:
        engine.start()
        if before is not None:
            await before(engine)
        try:
            return await asyncio.gather(*(one(i, p, sp) for i, (p, sp)
                                          in enumerate(zip(_prompts(), params))))
        finally:
            await asyncio.sleep(0.05)  # let the engine thread take a last abort
            engine.shutdown()

    return engine, asyncio.run(main())


def _assert_idle(engine: AsyncEngine) -> None:
    core = engine.engine
    assert not core.has_unfinished_requests()
    core.scheduler.check_integrity()
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert not core.outputs.states, "output state leaked"


@pytest.mark.parametrize("output_thread", [True, False])
def test_streams_are_exactly_the_offline_answers(tiny_path, output_thread):
    offline = _offline(tiny_path, _params())
    seen_threads: set[str] = set()
    engine, got = None, None

    async def spy(async_engine: AsyncEngine) -> None:
        process = async_engine.engine.outputs.process

        def recording(*args, **kwargs):
            seen_threads.add(threading.current_thread().name)
            return process(*args, **kwargs)
        async_engine.engine.outputs.process = recording

    engine, got = _serve(tiny_path, _params(), output_thread=output_thread, before=spy)
    for off, on in zip(offline, got):
        assert on["tokens"] == off.outputs[0].token_ids
        assert on["text"] == off.outputs[0].text
        assert on["finish"] == "length" and on["finished"]
    # the probe: output processing ran where the mode says it does
    assert seen_threads == {"tokenweir-output" if output_thread else "tokenweir-engine"}
    _assert_idle(engine)


def test_engine_steps_on_while_output_processing_is_held(tiny_path):
    """Output processing blocked: the engine thread still runs every step to the end (all
    requests finish in the scheduler), and nothing reaches a client until it is released."""
    release, held = threading.Event(), threading.Event()
    delivered_while_held: list[int] = []

    async def hold(async_engine: AsyncEngine) -> None:
        process = async_engine.engine.outputs.process

        def blocked(*args, **kwargs):
            held.set()
            release.wait(timeout=60)
            return process(*args, **kwargs)
        async_engine.engine.outputs.process = blocked

        async def watch() -> None:
            core = async_engine.engine
            # wait for the first step's outputs to be held (not for requests to show up in
            # the scheduler: on a fast machine they may all finish before a poll sees them)
            while not held.is_set():
                await asyncio.sleep(0.01)
            while core.has_unfinished_requests():  # the engine thread keeps stepping
                await asyncio.sleep(0.01)
            delivered_while_held.append(sum(q.qsize() for q in async_engine._queues.values()))
            release.set()
        asyncio.get_running_loop().create_task(watch())

    offline = _offline(tiny_path, _params())
    engine, got = _serve(tiny_path, _params(), before=hold)
    assert release.is_set() and delivered_while_held == [0], \
        "the engine finished only after outputs were processed, or outputs leaked out"
    assert [g["tokens"] for g in got] == [o.outputs[0].token_ids for o in offline]
    _assert_idle(engine)


def test_stop_string_ends_the_request_and_frees_its_blocks(tiny_path):
    free_text = _offline(tiny_path, _params())[1].outputs[0].text
    stop = free_text[len(free_text) // 2:len(free_text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {free_text!r}"
    offline = _offline(tiny_path, _params((stop,)))
    engine, got = _serve(tiny_path, _params((stop,)))
    assert offline[1].outputs[0].finish_reason == "stop"  # the probe: the stop string fired
    for off, on in zip(offline, got):
        assert on["text"] == off.outputs[0].text
        assert on["finish"] == off.outputs[0].finish_reason
        assert on["stop"] == off.outputs[0].stop_reason
    _assert_idle(engine)


def _hold_steps_until_aborted(request_id: str, timeout: float = 30):
    """A `before` hook for _serve: once `request_id` has a token, the engine thread waits
    (once, before its next step) until the client's abort for it was asked (AsyncEngine.abort),
    which then reaches the scheduler at the engine thread's next turn.
    Without it the abort races the engine: the client breaks after its first chunk, but the
    abort is sent only when asyncio finalizes the abandoned stream a few loop turns later, and
    on a loaded machine the engine thread had meanwhile run the request's 13 remaining steps
    to `length` (the abort then found nothing to abort: counted 0). Returns (hook, asked)."""
    asked, produced, waited = threading.Event(), threading.Event(), threading.Event()

    async def hook(async_engine: AsyncEngine) -> None:
        abort, core = async_engine.abort, async_engine.engine.core
        step = core.step

        def abort_and_tell(rid: str) -> None:
            abort(rid)
            if rid == request_id:
                asked.set()

        def held_step():
            if produced.is_set() and not waited.is_set():
                asked.wait(timeout)
                waited.set()
            outputs = step()
            if any(o.request.request_id == request_id and o.new_token_ids for o in outputs):
                produced.set()
            return outputs
        async_engine.abort = abort_and_tell
        core.step = held_step
    return hook, asked


def test_abort_mid_stream_frees_its_blocks(tiny_path):
    hold, asked = _hold_steps_until_aborted("r2")
    engine, got = _serve(tiny_path, _params(), abort=2, before=hold)
    assert asked.is_set(), "the client's abort never reached AsyncEngine.abort"
    assert not got[2]["finished"] and got[2]["chunks"] == 1  # the probe: it left early
    assert all(g["finish"] == "length" for i, g in enumerate(got) if i != 2)
    assert engine.stats.finished["abort"] == 1
    assert engine.stats.finished["length"] == NUM_PROMPTS - 1  # r2 did not run to its end
    _assert_idle(engine)


def test_processing_failure_fails_that_request_alone(tiny_path):
    offline = _offline(tiny_path, _params())
    with inject("detokenize", {"r3"}, skip=2) as record:
        engine, got = _serve(tiny_path, _params())
    assert record.fired, "the fault never fired"
    assert got[3]["finish"] == "error" and "InjectedFault" in (got[3]["error"] or "")
    for i, (off, on) in enumerate(zip(offline, got)):
        if i != 3:
            assert on["tokens"] == off.outputs[0].token_ids and on["error"] is None
    _assert_idle(engine)


def test_profile_accounts_for_every_step_and_token(tiny_path):
    profile = ServingProfile()
    engine, got = _serve(tiny_path, _params(), profile=profile)
    snap = profile.snapshot()
    tokens = sum(len(g["tokens"]) for g in got)
    assert snap["tokens"] == tokens == NUM_PROMPTS * 14
    assert snap["steps"] >= 14
    phases = snap["phases"]
    for name in ("schedule", "forward", "update", "output processing", "loop delivery"):
        assert phases[name]["seconds"] > 0, name
    assert snap["latencies"]["loop wait"]["count"] >= snap["steps"] - 1
    table = format_profile(snap)
    assert "forward" in table and "token -> wire" in table
    _assert_idle(engine)


def test_http_stream_with_profile_and_profile_route(tiny_path):
    """The real app over the output thread: a streamed completion arrives whole (SSE, [DONE]),
    GET /profile reports its steps, its tokens and SSE writes, and ?reset=1 starts afresh;
    without --profile-serving the route is 404."""
    from fastapi.testclient import TestClient

    from tokenweir.server.app import create_app
    from tokenweir.server.settings import ServerSettings

    offline = _offline(tiny_path, _params())[0].outputs[0]
    for profiled in (True, False):
        engine = AsyncEngine(LLM(tiny_path, **ENGINE).llm_engine,
                             profile=ServingProfile() if profiled else None)
        app = create_app(engine, ServerSettings(served_model_names=("tiny",), timeline_steps=0))
        with TestClient(app) as client:
            body = {"model": "tiny", "prompt": _prompts()[0]["prompt_token_ids"],
                    "max_tokens": 14, "temperature": 0, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]
                           if json.loads(line[6:])["choices"])
            assert text == offline.text
            answer = client.get("/profile")
            if not profiled:
                assert answer.status_code == 404
                continue
            snap = answer.json()
            assert snap["tokens"] == 14 and snap["steps"] >= 14
            assert snap["phases"]["SSE writing"]["seconds"] > 0
            assert snap["latencies"]["token -> wire"]["count"] >= 14
            client.get("/profile", params={"reset": 1})
            assert client.get("/profile").json()["tokens"] == 0
