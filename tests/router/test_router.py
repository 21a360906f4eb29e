"""`tokenweir router` against real `tokenweir serve` replicas on loopback: what it relays is
what a replica answers, its metrics carry every replica's with a `replica` label, a user's
routing policy plugs in, a client that leaves aborts on the replica, each replica's /timeline
and /profile are reached through it, and a replica that hangs or dies is taken out (its
requests end cleanly, the others go on) and taken back.

The replicas are module-scoped; the tests that hang and kill replica B run last."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from deployment import (API_KEY, HEADERS, metric, start_replica, start_router, stop,
                        wait_healthy)


@pytest.fixture(scope="module")
def replicas():
    started = []
    try:
        for _ in range(2):
            started.append(start_replica(None, "--profile-serving"))
        yield started
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.fixture
def router(replicas):
    routers = []

    def make(policy: str = "round-robin", *extra: str) -> str:
        proc, base = start_router([url for _, url in replicas], policy, *extra)
        routers.append(proc)
        return base
    yield make
    for proc in routers:
        stop(proc)


def post(base: str, path: str, body: dict, headers=HEADERS, timeout=120) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=timeout,
                      trust_env=False)


def stream_lines(base: str, body: dict, on_line=None) -> list[str]:
    lines = []
    with httpx.Client(trust_env=False, timeout=120) as http:
        with http.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                         headers=HEADERS) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    if on_line is not None:
                        on_line(len(lines))
    return lines


def stream_text(lines: list[str]) -> str:
    chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if "choices" in c)


def scrape(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=30, trust_env=False).text


GREEDY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
          "ignore_eos": True}


def test_streams_and_answers_are_the_replicas_own(router, replicas):
    base = router()
    direct = post(replicas[0][1], "/v1/completions", GREEDY).json()["choices"][0]["text"]
    for _ in range(2):  # round-robin: one of each replica
        lines = stream_lines(base, GREEDY)
        assert lines[-1] == "data: [DONE]" and stream_text(lines) == direct
        whole = post(base, "/v1/completions", GREEDY)
        assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == direct
    chat = post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    models = httpx.get(base + "/v1/models", headers=HEADERS, trust_env=False).json()
    assert models["data"][0]["id"] == "smollm2-135m"


def test_metrics_carry_each_replicas_with_its_label(router, replicas):
    base = router()
    urls = [url for _, url in replicas]
    before = scrape(base)
    for _ in range(4):
        assert post(base, "/v1/completions", {**GREEDY, "max_tokens": 2}).status_code == 200
    text = scrape(base)
    for url in urls:
        assert metric(text, "tokenweir:router_replica_up", replica=url) == 1
        assert metric(text, "tokenweir:router_routed_total", replica=url) == 2
        finished = (metric(text, "tokenweir:request_success_total", replica=url)
                    - metric(before, "tokenweir:request_success_total", replica=url))
        assert finished == 2  # the replica's own counter, relabelled
        assert metric(text, "tokenweir:num_requests_running", replica=url) == 0
    # probe: the same sample without the label would not tell the replicas apart
    assert metric(text, "tokenweir:request_success_total") >= 4


def test_a_users_routing_policy_plugs_in_by_import_path(router, replicas):
    base = router("routing_plugins:LastAvailable")
    last = replicas[1][1]
    for _ in range(3):
        assert post(base, "/v1/completions", {**GREEDY, "max_tokens": 2}).status_code == 200
    text = scrape(base)
    assert metric(text, "tokenweir:router_routed_total", replica=last) == 3
    assert metric(text, "tokenweir:router_routed_total", replica=replicas[0][1]) == 0


def test_key_body_limit_and_errors_are_serves(router, replicas):
    base = router("round-robin", "--api-key", API_KEY, "--max-request-body-bytes", "2000")
    replica = replicas[0][1]
    for target in (base, replica):  # the router answers exactly as a replica does
        no_key = post(target, "/v1/completions", GREEDY, headers={})
        assert no_key.status_code == 401
        assert no_key.json()["error"]["code"] == "invalid_api_key"
        bad = httpx.post(target + "/v1/completions", content=b"{nope", headers={
            **HEADERS, "Content-Type": "application/json"}, trust_env=False)
        assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
        relayed = post(target, "/v1/completions", {**GREEDY, "max_tokens": -1})
        assert relayed.status_code == 400 and relayed.json()["error"]["param"] == "max_tokens"
    big = post(base, "/v1/completions", {**GREEDY, "prompt": "x" * 3000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(base + "/health", trust_env=False).status_code == 200  # open


def test_a_client_that_leaves_aborts_on_the_replica(router, replicas):
    base = router("routing_plugins:LastAvailable")
    replica = replicas[1][1]
    aborted = metric(scrape(base), "tokenweir:request_success_total", replica=replica,
                     finished_reason="abort")
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", base + "/v1/completions", headers=HEADERS, json={
                **GREEDY, "max_tokens": 400, "stream": True}) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n >= 6:
                    break  # leave mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = metric(scrape(base), "tokenweir:request_success_total", replica=replica,
                     finished_reason="abort")
        if now == aborted + 1:
            break
        time.sleep(0.3)
    assert now == aborted + 1
    assert metric(scrape(base), "tokenweir:num_requests_running", replica=replica) == 0


# replica A's stream in the hung/killed tests: long enough to be in flight when B's stream
# has its first two chunks (B's prefill and two steps against A's decode steps), not much
# longer (it runs to its end after B is cut). The replicas run the tiny model
# (deployment.py), a fraction of SmolLM2's step: 80 tokens were enough on SmolLM2.
A_TOKENS = 300
# replica B's stream: still running when B is stopped or killed (cut, never run to its end)
B_TOKENS = 1900


def _stream_in_thread(base: str, max_tokens: int, results: dict, key: str) -> threading.Thread:
    """A stream on its own thread, returned once its client has received two chunks (so a
    replica failing after this is a failure mid-stream, not before the first byte)."""
    started = threading.Event()

    def run():
        results[key] = stream_lines(base, {**GREEDY, "max_tokens": max_tokens},
                                    on_line=lambda n: n >= 2 and started.set())
        started.set()
    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120)
    return thread


def _wait_for(check, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _in_flight(base: str, url: str) -> float:
    return metric(scrape(base), "tokenweir:router_in_flight", replica=url)


def get(base: str, path: str, headers=None) -> httpx.Response:
    return httpx.get(base + path, headers=headers or {}, timeout=60, trust_env=False)


def test_timeline_and_profile_are_each_replicas_own(router, replicas):
    """/profile and /timeline through the router are the replica's own pages (?replica= an
    index or URL); /profile alone holds every replica's; a reset passed on really resets the
    replica's profile (probe read from the replica directly)."""
    base = router()
    for _ in range(2):  # round-robin: one request on each replica
        assert post(base, "/v1/completions", {**GREEDY, "max_tokens": 3}).status_code == 200
    urls = [url for _, url in replicas]
    for index, url in enumerate(urls):
        own = get(url, "/profile").json()
        assert own["tokens"] > 0
        for name in (str(index), url):
            through = get(base, f"/profile?replica={name}").json()
            assert (through["steps"], through["tokens"]) == (own["steps"], own["tokens"])
    every = get(base, "/profile").json()["replicas"]
    assert sorted(every) == sorted(urls)
    assert all(every[url]["phases"].keys() == own["phases"].keys() for url in urls)
    missing = get(base, "/profile?replica=7")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "replica"

    assert get(base, "/timeline?replica=1").status_code == 401  # the router's key
    page = get(base, f"/timeline?replica=1&key={API_KEY}")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert page.text.startswith("<!") and "live schedule" in page.text
    index = get(base, f"/timeline?key={API_KEY}")  # two replicas: a page linking each
    assert all(url in index.text for url in urls)
    assert f'href="/timeline?replica=1&amp;key={API_KEY}"' in index.text

    assert get(base, "/profile?replica=0&reset=1").status_code == 200
    assert get(urls[0], "/profile").json()["tokens"] == 0  # probe: the reset reached it
    assert get(urls[1], "/profile").json()["tokens"] > 0


def test_a_hung_replica_is_taken_out_and_back_in(router, replicas):
    base = router()
    (_, a_url), (b_proc, b_url) = replicas
    results: dict = {}
    threads = [_stream_in_thread(base, A_TOKENS, results, "a")]
    threads.append(_stream_in_thread(base, B_TOKENS, results, "b"))  # still running when cut
    assert _in_flight(base, a_url) == 1 and _in_flight(base, b_url) == 1  # round-robin
    os.kill(b_proc.pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: metric(scrape(base), "tokenweir:router_replica_up",
                                 replica=b_url) == 0)
        during = [post(base, "/v1/completions", {**GREEDY, "max_tokens": 2})
                  for _ in range(3)]
        for thread in threads:
            thread.join(120)
    finally:
        os.kill(b_proc.pid, signal.SIGCONT)
    assert [r.status_code for r in during] == [200] * 3  # served by A
    assert stream_text(results["a"]) and results["a"][-1] == "data: [DONE]"
    assert len(results["b"]) < B_TOKENS  # probe: B's stream was cut, not run to its end
    error = json.loads(results["b"][-2][6:])["error"]  # B's stream ended in-band, then DONE
    assert error["code"] == "replica_failed" and b_url in error["message"]
    assert results["b"][-1] == "data: [DONE]"
    text = scrape(base)
    assert metric(text, "tokenweir:router_failed_total", replica=b_url) == 1
    # back in: B answers health checks again, and round-robin sends it requests
    _wait_for(lambda: metric(scrape(base), "tokenweir:router_replica_up", replica=b_url) == 1)
    routed = metric(scrape(base), "tokenweir:router_routed_total", replica=b_url)
    for _ in range(2):
        assert post(base, "/v1/completions", {**GREEDY, "max_tokens": 2}).status_code == 200
    assert metric(scrape(base), "tokenweir:router_routed_total", replica=b_url) == routed + 1


def test_a_killed_replica_fails_its_requests_cleanly_and_the_rest_succeed(router, replicas):
    base = router()
    unaware = router("round-robin", "--health-interval", "600")  # will not notice by itself
    (_, a_url), (b_proc, b_url) = replicas
    results: dict = {}
    threads = [_stream_in_thread(base, A_TOKENS, results, "a")]
    threads.append(_stream_in_thread(base, B_TOKENS, results, "b"))  # still running when cut
    assert _in_flight(base, a_url) == 1 and _in_flight(base, b_url) == 1  # round-robin
    b_proc.kill()
    assert b_proc.wait(30) == -signal.SIGKILL  # probe: B really died
    with pytest.raises(httpx.ConnectError):
        httpx.get(b_url + "/health", timeout=5, trust_env=False)
    for thread in threads:
        thread.join(120)
    assert results["a"][-1] == "data: [DONE]" and "error" not in results["a"][-2]
    assert len(results["b"]) < B_TOKENS  # probe: B's stream was cut, not run to its end
    error = json.loads(results["b"][-2][6:])["error"]
    assert error["code"] == "replica_failed" and results["b"][-1] == "data: [DONE]"
    after = [post(base, "/v1/completions", {**GREEDY, "max_tokens": 2}) for _ in range(3)]
    assert [r.status_code for r in after] == [200] * 3
    assert httpx.get(base + "/health", trust_env=False).status_code == 200
    # a router that still thinks B is up: the request sent to B moves to A, nothing lost
    moved = [post(unaware, "/v1/completions", {**GREEDY, "max_tokens": 2}) for _ in range(2)]
    assert [r.status_code for r in moved] == [200] * 2
    text = scrape(unaware)
    assert metric(text, "tokenweir:router_retries_total") == 1
    assert metric(text, "tokenweir:router_replica_up", replica=b_url) == 0
