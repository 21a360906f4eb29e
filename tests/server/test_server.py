"""End-to-end tests of `tokenweir serve`: one real server subprocess on 127.0.0.1, driven with
the official openai client and raw httpx. The last test sends SIGTERM and checks a clean exit.

The server runs tests/tiny_serve_model.py (SmolLM2-135M's tokenizer and template on a tiny
random-weight Llama, served as smollm2-135m): every test here is about the server's mechanics,
none about the model's text."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

import forkserver  # tests/forkserver.py
import probes  # tests/server/probes.py
import tiny_serve_model  # tests/tiny_serve_model.py

openai = probes.LazyModule("openai")

API_KEY = "test-key"
MODEL = "smollm2-135m"
MAX_WAITING = 80
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENWEIR_API_KEY": API_KEY,
           "NO_PROXY": "127.0.0.1"}
    cmd = [sys.executable, "-m", "tokenweir", "serve", tiny_serve_model.path(),
           *tiny_serve_model.SERVE_ARGS, "--dtype", "float32",
           "--max-model-len", "1024", "--num-gpu-blocks-override", "512", "--host",
           "127.0.0.1", "--port", str(port), "--max-waiting-requests", str(MAX_WAITING),
           "--drain-timeout", "10", "--log-level", "warning"]
    proc = forkserver.popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # tests/forkserver.py: torch preloaded
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400  # a first kernel build on a busy machine
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.1)
        yield {"base": base, "proc": proc}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60, http_client=httpx.Client(trust_env=False))


def _post(server, path, body, key=API_KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["base"] + path, json=body if raw is None else None,
                      content=raw, headers=headers, timeout=60, trust_env=False)


def _metrics(server) -> dict:
    text = httpx.get(server["base"] + "/metrics", timeout=10, trust_env=False).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            key = sample.name + (f"[{reason}]" if reason else "")
            values[key] = sample.value
    return values


def _poll_metrics(server, done, timeout: float, interval: float) -> dict:
    """The metrics once `done(metrics)` holds, or as they are at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if done(m) or time.monotonic() >= deadline:
            return m
        time.sleep(interval)


def _kv_free(m: dict) -> bool:
    return m["tokenweir:kv_cache_usage_perc"] == 0 and m["tokenweir:num_requests_running"] == 0


def _wait_kv_free(server, timeout=30.0) -> dict:
    m = _poll_metrics(server, _kv_free, timeout, 0.2)
    assert _kv_free(m), f"KV never freed: {m}"
    return m


def _assert_error(resp, status, fragment=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if fragment:
        assert fragment in err["message"], err["message"]


def _error_of_exception(exc: openai.APIStatusError) -> dict:
    """The OpenAI error object (message, type, param, code) the openai client parsed."""
    assert set(exc.body) == {"message", "type", "param", "code"}, exc.body
    return exc.body


# ---- happy paths ----------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data][0] == MODEL
    assert httpx.get(server["base"] + "/health", trust_env=False).status_code == 200


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, logprobs=2, seed=1, user="ignored")
    choice = r.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert len(choice.logprobs.tokens) == 8 and len(choice.logprobs.top_logprobs[0]) == 2
    again = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_chat_with_vllm_extras(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=6, temperature=0.7, top_p=0.9, seed=3, logprobs=True,
        top_logprobs=2, stop=["\n\n"],
        extra_body={"top_k": 20, "min_p": 0.01, "min_tokens": 2, "ignore_eos": True,
                    "priority": 1, "ttft_slo_ms": 500, "tpot_slo_ms": 80})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert r.usage.completion_tokens <= 6
    assert len(choice.logprobs.content[0].top_logprobs) == 2


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def test_penalties_and_logit_bias_with_the_openai_client(client):
    prompt = "List the colours of the rainbow, one per line:"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                          temperature=0, presence_penalty=2.0,
                                          frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.3})
    assert penalized.choices[0].text != plain.choices[0].text  # probe: the penalties acted
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"28": 100}, logprobs=0)
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1  # token 28, four times
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logit_bias={"28": 100})
    assert chat.choices[0].message.content == biased.choices[0].text


def test_tools_need_a_template_that_takes_them_but_tool_choice_none_works(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                       max_tokens=3)
    err = _error_of(exc)
    assert err["param"] == "tools" and "does not take tools" in err["message"]
    ok = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                        tool_choice="none", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert not ok.choices[0].message.tool_calls


def test_streaming_completion_is_incremental(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    pieces, usage, arrivals = [], None, []
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            arrivals.append(time.monotonic())
        if chunk.usage:
            usage = chunk.usage
    assert len(pieces) >= 6  # one chunk per step, not one blob
    assert arrivals[-1] > arrivals[0]
    assert usage.completion_tokens == 12
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert "".join(pieces) == full.choices[0].text


def test_streaming_chat_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


# ---- errors ---------------------------------------------------------------------------------
def test_prompt_too_long(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=list(range(100, 1200)), max_tokens=4)
    message = exc.value.body["message"]
    assert "1100" in message and "1024" in message


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(client):
    """vLLM answers 400; tokenweir clamped silently (issue 34: max_tokens 100000 ran 7 min)."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=list(range(100, 124)), max_tokens=100000)
    body = exc.value.body
    assert body["param"] == "max_tokens"
    assert "max_tokens=100000" in body["message"] and "1024" in body["message"]
    fits = client.completions.create(model=MODEL, prompt=list(range(100, 124)), max_tokens=2)
    assert fits.usage.completion_tokens <= 2  # probe: the same prompt with room is served


def test_unknown_model_and_malformed_json(server):
    _assert_error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 400,
                  "gpt-9")
    _assert_error(_post(server, "/v1/chat/completions", None, raw=b"{not json"), 400,
                  "malformed JSON")
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)


def _error_of(exc_info) -> dict:
    """The OpenAI error object the openai client parsed out of the response."""
    return _error_of_exception(exc_info.value)


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"n": 0}, "n", "n must be"),
    ({"temperature": -1}, None, "temperature"),
    ({"top_p": 0}, None, "top_p"),
    ({"max_tokens": 0}, None, "max_tokens"),
    ({"logprobs": 99}, "logprobs", "logprobs"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"model": "gpt-9"}, "model", "gpt-9"),
])
def test_completion_errors_with_openai_client(client, kwargs, param, fragment):
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**args)
    err = _error_of(exc)
    assert exc.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert fragment in err["message"], err["message"]
    if param:
        assert err["param"] == param


def test_chat_errors_with_openai_client(server, client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, n=300)
    assert _error_of(exc)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="no-such-model", messages=messages)
    assert _error_of(exc)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:  # malformed JSON, sent raw by the client
        client.post("/chat/completions", cast_to=object, content=b'{"model": "x", ',
                    options={"headers": {"Content-Type": "application/json"}})
    assert "malformed JSON" in _error_of(exc)["message"]
    with pytest.raises(openai.AuthenticationError) as exc:
        openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0,
                      http_client=httpx.Client(trust_env=False)).models.list()
    assert exc.value.status_code == 401 and _error_of(exc)["code"] == "invalid_api_key"
    # no error takes the engine down: the next request is served
    ok = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens > 0


def test_auth(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, key=None), 401)
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, key="wrong"), 401)
    assert httpx.get(server["base"] + "/v1/models", trust_env=False).status_code == 401
    assert httpx.get(server["base"] + "/health", trust_env=False).status_code == 200


# ---- metrics and abort ----------------------------------------------------------------------
def test_metrics_parse_and_move(server, client):
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5,
                              extra_body={"ignore_eos": True})
    after = _metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "iteration_tokens_total_count",
                 "inter_token_latency_seconds_count", "request_queue_time_seconds_count"):
        assert "tokenweir:" + name in after, name
    assert after["tokenweir:generation_tokens_total"] >= \
        before["tokenweir:generation_tokens_total"] + 5
    assert after["tokenweir:prompt_tokens_total"] > before["tokenweir:prompt_tokens_total"]
    assert after["tokenweir:request_success_total[length]"] == \
        before["tokenweir:request_success_total[length]"] + 1
    assert after["tokenweir:time_to_first_token_seconds_count"] == \
        before["tokenweir:time_to_first_token_seconds_count"] + 1
    assert after["tokenweir:e2e_request_latency_seconds_count"] == \
        before["tokenweir:e2e_request_latency_seconds_count"] + 1


# vLLM's metric names (vllm/v1/metrics/loggers.py, vllm 0.32) and Prometheus types that
# tokenweir exports under its own prefix; labels model_name and engine as vLLM's.
VLLM_METRICS = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "num_preemptions": "counter", "prompt_tokens": "counter",
    "generation_tokens": "counter", "request_success": "counter",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "iteration_tokens_total": "histogram",
}


def test_metric_names_types_and_labels_match_vllm(server):
    text = httpx.get(server["base"] + "/metrics", timeout=10, trust_env=False).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_METRICS.items():
        family = families.get("tokenweir:" + name)
        assert family is not None, name
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in families["tokenweir:request_success"].samples
               if s.name.endswith("_total")}
    assert {"stop", "length", "abort", "error"} <= reasons
    assert not any(n.startswith("vllm:") for n in families)


def test_disconnect_mid_stream_frees_kv(server):
    before = _wait_kv_free(server)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chunks = 0
    saw_kv_in_use = False
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", server["base"] + "/v1/completions", json=body,
                         headers=headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks == 3:
                    m = _metrics(server)
                    saw_kv_in_use = m["tokenweir:kv_cache_usage_perc"] > 0 and \
                        m["tokenweir:num_requests_running"] == 1
                    break
    # probe: the stream really started and held KV blocks
    assert chunks == 3 and saw_kv_in_use
    _wait_kv_free(server)
    # the abort is counted by the output path, which may trail the scheduler's free by a
    # moment (seen once in CI under load: KV free, counter not yet moved)
    abort = "tokenweir:request_success_total[abort]"
    after = _poll_metrics(server, lambda m: m[abort] == before[abort] + 1, 10.0, 0.1)
    assert after[abort] == before[abort] + 1
    assert after["tokenweir:generation_tokens_total"] - \
        before["tokenweir:generation_tokens_total"] < 900  # it did not run to the end


def test_overload_returns_503_with_retry_after(server, client):
    async def one(aclient):
        try:
            # 500-token prompts: four fill a step's budget, so that even the tiny model's
            # fast steps start them more slowly than they arrive (120 tokens: 17 a step)
            await aclient.completions.create(model=MODEL, prompt=list(range(1000, 1500)),
                                             max_tokens=1)
            return 200
        except openai.APIStatusError as exc:
            return exc

    async def go():
        aclient = openai.AsyncOpenAI(
            base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
            http_client=httpx.AsyncClient(trust_env=False,
                                          limits=httpx.Limits(max_connections=200)))
        return await asyncio.gather(*[one(aclient) for _ in range(2 * MAX_WAITING)])

    outcomes = asyncio.run(go())
    rejected = [o for o in outcomes if o != 200]
    assert rejected and 200 in outcomes, outcomes  # probe: the queue really overflowed
    for exc in rejected:
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503, exc
    assert int(rejected[0].response.headers["retry-after"]) >= 1
    err = _error_of_exception(rejected[0])
    assert "waiting" in err["message"] and err["type"] == "service_unavailable"
    _wait_kv_free(server)
    # the overload took nothing down: the next request is served
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


# ---- load -----------------------------------------------------------------------------------
# Tokens per stream: enough that a stream is still running when the client has opened the
# crowd's others. On the tiny model 8 tokens, as on SmolLM2, were not: in an exclusive full
# run the server held 17 at once at most. 16 and 24 held 64 in runs of this file (contended).
LOAD_TOKENS = 24


def test_load_64_concurrent_streams(server):
    # two waves of 64: every slot is refilled once as its stream ends (256 ran four waves for
    # the same assertions, ~28 s of the suite)
    total, concurrency = 128, 64
    health_codes: list[int] = []
    in_flight: list[float] = []  # running + waiting, as /metrics saw it during the load
    stop = threading.Event()

    def probe_health():
        with httpx.Client(trust_env=False, timeout=10) as http:
            while not stop.is_set():
                health_codes.append(http.get(server["base"] + "/health").status_code)
                m = _metrics(server)
                in_flight.append(m["tokenweir:num_requests_running"]
                                 + m["tokenweir:num_requests_waiting"])
                time.sleep(0.2)

    async def one(aclient, sem, i):
        async with sem:
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"Request number {i}: say something.",
                max_tokens=LOAD_TOKENS,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

    async def go():
        aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY,
                                     max_retries=0, timeout=120,
                                     http_client=httpx.AsyncClient(
                                         trust_env=False,
                                         limits=httpx.Limits(max_connections=concurrency)))
        sem = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*[one(aclient, sem, i) for i in range(total)],
                                    return_exceptions=True)

    prober = threading.Thread(target=probe_health)
    prober.start()
    started = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(go(), timeout=150))
    finally:
        stop.set()
        prober.join()
    elapsed = time.monotonic() - started
    failures = [r for r in results if not isinstance(r, int)]
    assert not failures, [(f, f.__cause__) for f in failures[:3]]
    assert all(r == LOAD_TOKENS for r in results)
    assert health_codes and all(c == 200 for c in health_codes)
    assert len(health_codes) >= 2 or elapsed < 1
    # probe: the server really held a crowd at once (64 when measured)
    assert max(in_flight) >= 32, (max(in_flight), in_flight)
    _wait_kv_free(server)


# ---- bench serve -----------------------------------------------------------------------------
def _bench_serve(server, tmp_path, key, name):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "tokenweir", "bench", "serve", "--base-url",
           server["base"], "--model", MODEL, "--api-key", key, "--num-prompts", "6",
           "--input-len", "16", "--output-len", "4", "--length-dist", "uniform",
           "--request-rate", "20", "--goodput", "ttft:600000", "--save-result", str(out),
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_PROXY": "127.0.0.1"})
    return proc, json.loads(out.read_text())


def test_bench_serve_cli_against_live_server(server, tmp_path):
    before = _metrics(server)
    proc, result = _bench_serve(server, tmp_path, API_KEY, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Serving Benchmark Result" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_tpot_ms"] > 0
    # the client's token counts are the server's: it generated exactly what the client counted
    after = _metrics(server)
    assert result["total_output_tokens"] == \
        after["tokenweir:generation_tokens_total"] - before["tokenweir:generation_tokens_total"]
    # probe: a failing endpoint is reported as failures, not as a fast benchmark
    proc, bad = _bench_serve(server, tmp_path, "wrong-key", "bad")
    assert proc.returncode == 1 and bad["completed"] == 0 and bad["failed"] == 6
    assert "401" in bad["errors"][0]


def test_live_timeline_shows_the_steps_just_served_behind_the_api_key(server, client):
    """GET /timeline: the schedule page over the server's recent steps. Behind the API key
    (header, or ?key= for a browser's reloads); the page holds the steps of a completion
    served just before, and reloads itself."""
    done = client.completions.create(model=MODEL, prompt="Timeline probe: count to five.",
                                     max_tokens=6, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6  # the probe: steps really ran
    url = server["base"] + "/timeline"
    assert httpx.get(url, timeout=30, trust_env=False).status_code == 401
    assert httpx.get(url, params={"key": "wrong"}, timeout=30, trust_env=False).status_code == 401
    page = httpx.get(url, params={"key": API_KEY}, timeout=60, trust_env=False)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    data = json.loads(re.search(r'<script id="timeline-data" type="application/json">(.*?)'
                                r'</script>', page.text, re.S).group(1))
    assert "refreshSeconds" in page.text
    rows = json.dumps(data)
    assert done.id.removeprefix("cmpl-") in rows or done.id in rows
    header = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       trust_env=False)
    assert header.status_code == 200


# ---- shutdown (last: it stops the module's server) ------------------------------------------
def test_sigterm_graceful(server):
    proc = server["proc"]
    body = {"model": MODEL, "prompt": "A story:", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    pieces = []
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", server["base"] + "/v1/completions", json=body,
                         headers=headers) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                    pieces.append(json.loads(line[6:]))
                    break
            for line in lines:
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:]))
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"  # the running one finished
    assert proc.wait(timeout=60) == 0

