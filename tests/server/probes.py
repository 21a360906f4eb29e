"""Reproductions of issue 14 (server half) against a live `tokenweir serve`, each paired with a
neighbouring streamed completion that must still finish in full.

Used by tests/server/test_robustness.py, and runnable by hand to measure a checkout:

    python tests/server/probes.py ROOT   # starts servers from checkout ROOT, prints a table
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import forkserver  # noqa: E402  (tests/forkserver.py)

class LazyModule:
    """A module imported at its first attribute read, not when a test file is collected (every
    xdist worker collects every file; one runs it): `openai = LazyModule("openai")` spares
    the workers that never use it openai's import (~0.55-0.85 s). Where the module is
    missing, the test that reads it is skipped (pytest.importorskip)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        import pytest

        return getattr(pytest.importorskip(self._name), attr)


API_KEY = "probe-key"
MODEL = "smollm2-135m"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NEIGHBOUR_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: str, *extra: str, drain_timeout: float = 10.0,
                 model: str = MODEL) -> tuple[subprocess.Popen, str]:
    """A `tokenweir serve` subprocess from checkout `root`; returns (process, base url) once
    /health answers. Its output goes to a pipe (read it after it exits)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENWEIR_API_KEY": API_KEY,
           "NO_PROXY": "127.0.0.1", "PYTHONPATH": root}
    cmd = [sys.executable, "-m", "tokenweir", "serve", model, "--dtype", "float32",
           "--max-model-len", "1024", "--num-gpu-blocks-override", "512", "--host",
           "127.0.0.1", "--port", str(port), "--drain-timeout", str(drain_timeout),
           "--log-level", "warning", *extra]
    proc = forkserver.popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # tests/forkserver.py: torch preloaded
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up")
        time.sleep(0.1)  # a poll costs ~1 ms; a late one, a start's idle wait


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server from start_server and wait for it to exit; kill it after 60 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def post(base: str, path: str, body: Any = None, raw: Optional[bytes] = None,
         timeout: float = 120) -> httpx.Response:
    headers = {**HEADERS, "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(base + path, content=content, headers=headers, timeout=timeout,
                      trust_env=False)


def read_stream(base: str, body: dict, on_first=None) -> dict:
    """Streams a completion; returns its chunks' finish reason, token count, [DONE], errors."""
    result: dict = {"finish_reason": None, "chunks": 0, "done": False, "errors": [],
                    "status": None}
    with httpx.Client(trust_env=False, timeout=120) as http:
        with http.stream("POST", base + "/v1/completions", json=body,
                         headers=HEADERS) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["errors"].append(chunk["error"]["message"])
                        continue
                    result["chunks"] += 1
                    if result["chunks"] == 1 and on_first is not None:
                        on_first()
                    reason = chunk["choices"][0]["finish_reason"] if chunk["choices"] else None
                    result["finish_reason"] = reason or result["finish_reason"]
    return result


def _complete(out: dict) -> bool:
    """A neighbour's result is complete: finish_reason length, as many chunks as the tokens it
    asked for (`out["tokens"]`, NEIGHBOUR_TOKENS where unsaid), [DONE]."""
    return (out.get("finish_reason") == "length" and out.get("done") is True
            and out.get("chunks") == out.get("tokens", NEIGHBOUR_TOKENS)
            and not out.get("errors"))


@contextmanager
def neighbour(base: str, tokens: int = NEIGHBOUR_TOKENS) -> Iterator[dict]:
    """A streamed completion in flight around the block; afterwards the dict says whether it
    completed in full (`ok`: finish_reason length, `tokens` chunks, [DONE]). Inside
    the block, `out["ended"]` (an Event) is set once its stream has ended."""
    out: dict = {"tokens": tokens}
    started = threading.Event()
    ended = out["ended"] = threading.Event()
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": tokens,
            "ignore_eos": True, "stream": True}

    def run() -> None:
        try:
            out.update(read_stream(base, body, on_first=started.set))
        except Exception as exc:  # noqa: BLE001 - reported in the result
            out["errors"] = [repr(exc)]
        started.set()
        ended.set()

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(60)
    try:
        yield out
    finally:
        thread.join(120)
        out["ok"] = _complete(out)


def _error(resp: httpx.Response) -> dict:
    try:
        return resp.json().get("error") or {}
    except ValueError:
        return {"message": resp.text[:200]}


def _answer(base: str, path: str, body: Any, raw: Optional[bytes]) -> dict:
    t0 = time.monotonic()
    resp = post(base, path, body, raw)
    elapsed = time.monotonic() - t0
    err = _error(resp) if resp.status_code >= 400 else {}
    return {"status": resp.status_code, "param": err.get("param"),
            "message": (err.get("message") or "")[:120], "seconds": round(elapsed, 2)}


def probe_request(base: str, path: str, body: Any = None, raw: Optional[bytes] = None,
                  tokens: int = NEIGHBOUR_TOKENS) -> dict:
    """One bad request beside a neighbour: its status, error param, time and the neighbour."""
    with neighbour(base, tokens) as n:
        result = _answer(base, path, body, raw)
    return {**result, "neighbour_ok": n["ok"]}


def probe_requests(base: str, requests: dict[str, tuple[str, Any, Optional[bytes]]],
                   tokens: int = NEIGHBOUR_TOKENS) -> dict[str, dict]:
    """probe_request for each named (path, body, raw), several beside one neighbour: each is
    answered while its neighbour still streams, and its `neighbour_ok` says whether that
    neighbour then completed in full. A request answered after its neighbour had completed
    in full is sent again beside the next one (a neighbour that ended otherwise fails every
    request it was beside: none is retried, so a request that breaks streams cannot hide)."""
    results: dict[str, dict] = {}
    pending = list(requests)
    while pending:
        beside: list[str] = []
        with neighbour(base, tokens) as n:
            while pending:
                result = _answer(base, *requests[pending[0]])
                if n["ended"].is_set() and _complete(n) and beside:
                    break  # answered after the neighbour: again beside the next one
                results[pending[0]] = result
                beside.append(pending.pop(0))
                if n["ended"].is_set():
                    break
        for name in beside:
            results[name]["neighbour_ok"] = n["ok"]
    return results


def nested(depth: int, leaf: str = "1") -> bytes:
    return b"[" * depth + leaf.encode() + b"]" * depth


def completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


CHAT_MESSAGES = [{"role": "user", "content": "Hi"}]

# name -> (path, json body or None, raw body or None)
BAD_REQUESTS: dict[str, tuple[str, Any, Optional[bytes]]] = {
    "lone surrogate prompt": ("/v1/completions", None,
                              b'{"prompt": "abc \\ud800", "max_tokens": 4}'),
    "JSON nested 100,000 deep": ("/v1/completions", None, nested(100_000)),
    "prompt nested 5,000 deep": ("/v1/completions", None,
                                 b'{"max_tokens": 4, "prompt": ' + nested(5_000) + b"}"),
    "chat text part 5": ("/v1/chat/completions",
                         {"messages": [{"role": "user",
                                        "content": [{"type": "text", "text": 5}]}]}, None),
    "stop_token_ids ['a'] + min_tokens 2": (
        "/v1/completions", completion(stop_token_ids=["a"], min_tokens=2), None),
    "top_k 1e400": ("/v1/completions", None,
                    b'{"prompt": "Hi", "max_tokens": 4, "top_k": 1' + b"0" * 400 + b"}"),
    "best_of 3 streamed": ("/v1/completions", completion(best_of=3, stream=True), None),
    "logit_bias outside the vocabulary": ("/v1/completions",
                                          completion(logit_bias={"999999": 100}), None),
    "logit_bias 101": ("/v1/completions", completion(logit_bias={"50": 101}), None),
    "response_format bad schema": ("/v1/chat/completions",
                                   {"messages": CHAT_MESSAGES, "response_format": {
                                       "type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                                   None),
    "tools": ("/v1/chat/completions",
              {"messages": CHAT_MESSAGES, "tools": [{"type": "function", "function": {
                  "name": "f", "parameters": {"type": "object"}}}]}, None),
    "tool_choice": ("/v1/chat/completions",
                    {"messages": CHAT_MESSAGES, "tool_choice": "required"}, None),
    "suffix": ("/v1/completions", completion(suffix="!"), None),
    "presence_penalty 2.5": ("/v1/completions", completion(presence_penalty=2.5), None),
    "repetition_penalty 0": ("/v1/completions", completion(repetition_penalty=0), None),
    "frequency_penalty 'x'": ("/v1/completions", completion(frequency_penalty="x"), None),
    "n 300": ("/v1/completions", completion(n=300), None),
    "10 MB body, unknown field": ("/v1/completions", None,
                                  b'{"prompt": "Hi", "max_tokens": 2, "junk": "'
                                  + b"a" * 10_000_000 + b'"}'),
}


def probe_big_prompt(base: str, size: int = 10_000_000,
                     tokens: int = NEIGHBOUR_TOKENS) -> dict:
    """A `size`-character prompt beside a neighbour, with /health polled meanwhile: the
    longest /health answer time shows whether the event loop was blocked."""
    raw = b'{"max_tokens": 2, "prompt": "' + b"hello " * (size // 6) + b'"}'
    waits: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(trust_env=False, timeout=60) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                http.get(base + "/health")
                waits.append(time.monotonic() - t0)
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = probe_request(base, "/v1/completions", raw=raw, tokens=tokens)
    finally:
        stop.set()
        poller.join()
    result["max_health_s"] = round(max(waits), 2) if waits else None
    return result


def probe_second_sigint(root: str) -> dict:
    """SIGINT twice while a long stream runs: the exit status and the last words."""
    proc, base = start_server(root)
    body = {"model": MODEL, "prompt": "A story:", "max_tokens": 900, "ignore_eos": True,
            "stream": True}

    def signal_twice() -> None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)

    try:
        read_stream(base, body, on_first=signal_twice)
    except httpx.HTTPError:
        pass
    code = proc.wait(timeout=60)
    tail = proc.stdout.read().decode(errors="replace").strip().splitlines()[-3:]
    return {"exit": code, "tail": tail}


def probe_drain_timeout(root: str) -> dict:
    """SIGTERM with --drain-timeout 2 while a long stream runs: how that stream ends."""
    proc, base = start_server(root, drain_timeout=2.0)
    body = {"model": MODEL, "prompt": "A story:", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    try:
        result = read_stream(base, body, on_first=lambda: proc.send_signal(signal.SIGTERM))
    except httpx.HTTPError as exc:
        result = {"error": repr(exc)}
    code = proc.wait(timeout=60)
    log = proc.stdout.read().decode(errors="replace")
    return {"finish_reason": result.get("finish_reason"), "done": result.get("done"),
            "exit": code, "cancelled_error_in_log": "CancelledError" in log}


def main(root: str) -> None:
    proc, base = start_server(root)
    rows = _Printed()
    try:
        for name, (path, body, raw) in BAD_REQUESTS.items():
            rows.append((name, probe_request(base, path, body, raw)))
        rows.append(("10 MB prompt", probe_big_prompt(base)))
        alive = post(base, "/v1/completions", completion()).status_code
        rows.append(("a plain request afterwards", {"status": alive}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    for i in range(3):
        rows.append((f"second SIGINT, run {i + 1}", probe_second_sigint(root)))
    rows.append(("SIGTERM, --drain-timeout 2", probe_drain_timeout(root)))


class _Printed(list):
    def append(self, row: tuple) -> None:
        super().append(row)
        print(f"| {row[0]} | {json.dumps(row[1], ensure_ascii=True)} |", flush=True)


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "."))
