"""`tokenweir serve --engine-process` (engine/core_client.py, engine/core_process.py): the
engine core in a process of its own answers exactly what the in-process server answers; an
abort or a client's disconnect reaches the core; a core that dies makes the server say so.

Each test starts real servers (tests/server/probes.py: forked with torch preloaded)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

import engine_answers as ea
from probes import HEADERS, MODEL, post, read_stream, start_server, stop_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(base + "/metrics", trust_env=False, timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def _tokens(choices: list) -> list:
    """Every token string the answer's logprobs name (the probe that ids were compared)."""
    found = []
    for choice in choices:
        logprobs = choice.get("logprobs") or {}
        found += logprobs.get("tokens") or [e["token"] for e in logprobs.get("content") or []]
    return found


@pytest.fixture(scope="module")
def both():
    """(in-process base url, engine-process base url); the latter's process object too."""
    local, local_base = start_server(ROOT, "--no-engine-process")
    remote, remote_base = start_server(ROOT, "--engine-process")
    yield local_base, remote_base, remote
    stop_server(local)
    stop_server(remote)


def test_the_same_answers_through_both_paths_as_recorded_and_metrics_count(both):
    """Both paths answer engine_answers.REQUESTS exactly as each other and as recorded before
    AsyncEngine's refactor (engine_answers.json: choices, token strings, logprobs, finish
    reasons, usage, and how much every /metrics counter and count grew)."""
    local, remote, _ = both
    golden = json.loads(ea.GOLDEN.read_text(encoding="utf-8"))
    got = {"--no-engine-process": ea.record(local), "--engine-process": ea.record(remote)}
    assert not ea.differences(got["--engine-process"], got["--no-engine-process"])
    # probes: the recording holds enough to compare (token strings, every finish reason, the
    # core's counters sent with each tick and the API side's histograms)
    answers = golden["--engine-process"]["answers"]
    assert sum(len(_tokens(a["choices"])) for a in answers if a["usage"]) > 40
    grew = golden["--engine-process"]["grew"]
    assert _grew(grew, "tokenweir:generation_tokens_total") >= 60
    assert _grew(grew, "tokenweir:request_success_total", 'finished_reason="stop"') == 1
    assert _grew(grew, "tokenweir:time_to_first_token_seconds_count") == len(ea.REQUESTS)
    assert httpx.get(remote + "/timeline", headers=HEADERS, trust_env=False,
                     timeout=60).status_code == 200
    if golden["machine"] != ea.machine():  # kernels may round a near-tie otherwise
        pytest.skip(f"the two paths agree; the recording is from {golden['machine']}, "
                    f"not {ea.machine()}: not compared")
    for flag, recorded in got.items():
        assert not ea.differences(recorded, golden[flag]), (flag, ea.differences(
            recorded, golden[flag])[:5])


def _grew(grew: dict, name: str, label: str = "") -> float:
    return sum(v for k, v in grew.items() if k.startswith(name + "{") and label in k)


def test_a_disconnect_and_an_abort_reach_the_core(both):
    _, remote, _ = both
    aborted = _metric(remote, "tokenweir:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(trust_env=False, timeout=120) as http:
        with http.stream("POST", remote + "/v1/completions", json=body,
                         headers=HEADERS) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            # probe: the core runs it (its scheduler's count, through the core's metrics)
            _wait_for(lambda: _metric(remote, "tokenweir:num_requests_running") == 1, 30)
    # the client hung up: the stream's abort goes to the core, whose running count drops
    # long before 900 tokens could be computed
    _wait_for(lambda: _metric(remote, "tokenweir:num_requests_running") == 0, 10)
    assert _metric(remote, "tokenweir:request_success_total",
                   finished_reason="abort") == aborted + 1


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    """Running (a zombie, or no process at all, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_core_fails_requests_and_health():
    server, base = start_server(ROOT, "--engine-process")
    try:
        cores = _children(server.pid)
        assert len(cores) == 1, cores
        core = cores[0]
        assert post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                              "max_tokens": 2}).status_code == 200
        result: dict = {}
        started = threading.Event()
        body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=lambda: result.update(
            read_stream(base, body, on_first=started.set)))
        reader.start()
        assert started.wait(60)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(core):  # probe: the core is really dead
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reader.join(30)
        assert not reader.is_alive(), "the stream in flight never ended"
        assert result["errors"] and "engine core process" in result["errors"][0], result
        assert result["finish_reason"] != "length"
        health = httpx.get(base + "/health", trust_env=False, timeout=10)
        assert health.status_code == 503
        refused = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                 "max_tokens": 2})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and "engine core process" in \
            error["message"], error
        assert refused.headers["Retry-After"]
    finally:
        stop_server(server)
    assert server.returncode == 0
