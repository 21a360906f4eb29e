"""What a served engine answers to a fixed set of requests, through either engine path
(`--no-engine-process`: AsyncEngine over an LLMEngine on its engine thread; `--engine-process`:
over a RemoteEngine and the core process), recorded so that a change to AsyncEngine's plumbing
can be shown to change nothing (engine_answers.json; test_engine_process.py compares).

A recording per path: each request's choices (a stream's chunks, in order, without ids and
timestamps: texts, token strings, logprobs, finish reasons, indices) and usage, and how much each
request counter and histogram count of /metrics grew over the set (sent one at a time, read once
the engine is idle). The counts are deterministic except those of steps and generated tokens
(STEP_COUNTS): a stop string is found on the output side while the engine may already run the
request's next step (its token computed, counted and dropped: engine/async_engine.py), so a
request with a stop string may cost one step and one token more, or not.

    python tests/server/engine_answers.py [ROOT]   # re-records engine_answers.json from ROOT

Recorded on start10's base (main 12e85ad), before the AsyncEngine refactor (one interface for
the core's side), on a 2-vCPU AMD EPYC (AVX2 + FMA), torch 2.13.0, SmolLM2-135M float32.
Logprobs compare within LOGPROB_TOL (another CPU's kernels may round differently); every other
field compares exactly.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probes import HEADERS, MODEL, post, start_server, stop_server  # noqa: E402

from tokenweir.cpu_info import cpu_flags  # noqa: E402

GOLDEN = Path(__file__).with_name("engine_answers.json")
LOGPROB_TOL = 1e-3
# /metrics lines that count steps or generated tokens: each may differ by the number of
# requests with stop strings (above).
STEP_COUNTS = ("tokenweir:num_steps_total", "tokenweir:iteration_tokens_total_count",
               "tokenweir:generation_tokens_total")

# A few greedy and seeded requests, streamed and not, with the features whose state the API
# side rebuilds from the core's records: logprobs, stop strings, parallel samples.
REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12,
                         "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9,
                         "seed": 7, "logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "List three colours:", "max_tokens": 24, "temperature": 0.7,
                         "seed": 11, "stop": [","], "logprobs": 1}),
    ("/v1/completions", {"prompt": "A name for a cat:", "max_tokens": 8, "temperature": 1.0,
                         "seed": 3, "n": 3, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                              "max_tokens": 10, "temperature": 0, "logprobs": True,
                              "top_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}],
                              "max_tokens": 12, "temperature": 0.8, "seed": 5,
                              "stream": True}),
]


def answer(base: str, path: str, body: dict) -> dict:
    """{"choices": a reply's choices, or a stream's chunks' choices in order; "usage"}."""
    body = {"model": MODEL, **body}
    if not body.get("stream"):
        reply = post(base, path, body)
        assert reply.status_code == 200, reply.text
        return {"choices": reply.json()["choices"], "usage": reply.json()["usage"]}
    chunks = []
    with httpx.Client(trust_env=False, timeout=120) as http:
        with http.stream("POST", base + path, json=body, headers=HEADERS) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"])
    return {"choices": chunks, "usage": None}


def counts(base: str) -> dict[str, float]:
    """Every counter and histogram count of /metrics (line without its value -> value)."""
    text = httpx.get(base + "/metrics", trust_env=False, timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if key.split("{")[0].endswith(("_total", "_count")):
            found[key] = float(value)
    return found


def idle_counts(base: str, seconds: float = 30) -> dict[str, float]:
    """`counts` once /metrics says nothing runs or waits (the snapshot after the last step)."""
    deadline = time.monotonic() + seconds
    while True:
        text = httpx.get(base + "/metrics", trust_env=False, timeout=30).text
        busy = [line for line in text.splitlines() if line.startswith(
            ("tokenweir:num_requests_running{", "tokenweir:num_requests_waiting{"))]
        if busy and all(float(line.rsplit(" ", 1)[1]) == 0 for line in busy):
            return counts(base)
        assert time.monotonic() < deadline, f"the engine is still busy: {busy}"
        time.sleep(0.05)


def record(base: str) -> dict:
    """{"answers": [answer per REQUESTS entry], "grew": {metric line: growth over the set}}."""
    before = counts(base)
    answers = [answer(base, path, body) for path, body in REQUESTS]
    after = idle_counts(base)
    grew = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v != before.get(k, 0.0)}
    return {"answers": answers, "grew": grew}


def differences(got, want, where: str = "") -> list[str]:
    """Where `got` differs from `want`: floats under a "logprob" key within LOGPROB_TOL, step
    counts (STEP_COUNTS) within the number of requests with stop strings, everything else
    exactly."""
    if any(where.startswith(f".grew.{name}{{") for name in STEP_COUNTS):
        slack = sum(1 for _, body in REQUESTS if body.get("stop"))
        return [] if abs(got - want) <= slack else [f"{where}: {got} != {want}"]
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, float) and "logprob" in where:
        return [] if math.isclose(got, want, abs_tol=LOGPROB_TOL) else [f"{where}: {got} != {want}"]
    return [] if got == want and type(got) is type(want) else [f"{where}: {got!r} != {want!r}"]


# The CPU features the model's kernels choose their code by: token ids recorded on one kind of
# machine are compared exactly only on the same kind (another may round a near-tie the other way).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def machine() -> dict:
    """{"cpu_flags": the KERNEL_FLAGS this CPU has, "torch": its version}."""
    import torch  # only the recording's comparison needs it
    flags = cpu_flags()
    return {"cpu_flags": [f for f in KERNEL_FLAGS if f in flags], "torch": torch.__version__}


def main(root: str) -> None:
    recorded = {"machine": machine()}
    for flag in ("--no-engine-process", "--engine-process"):
        server, base = start_server(root, flag)
        try:
            recorded[flag] = record(base)
        finally:
            stop_server(server)
    GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                         os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
