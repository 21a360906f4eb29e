"""The step-record format: what one engine step did, one JSON object per line (JSONL).

Two kinds of line; `"type"` tells them apart (absent means "step"):

    {"type": "step", "step": 12, "start": 0.731, "duration": 0.0412,
     "reqs": [{"id": "r3", "prefill": 256, "decode": 0, "context": 512},
              {"id": "r1", "prefill": 0, "decode": 1, "context": 301}],
     "preempted": ["r7"], "swapped": ["r5"], "cut": [], "paused": ["r4"],
     "running": 3, "waiting": 9, "kv_usage": 0.84, "prefix_hits": 128}

- `step`: index of the step in its run (increasing); `start`, `duration`: seconds (the
  engine's clock: virtual for the simulator, wall for the real engine).
- `reqs`: every request scheduled this step: `prefill` tokens (prompt, or recomputed after a
  preemption) and `decode` tokens (1 for a plain decode) it ran, and `context`, its computed
  tokens after the step. Optional per-request key `estimated: true` when the split was derived
  (the chrome-trace converter), not observed.
- `preempted`: preempted by recompute when this step was planned (their KV was dropped).
- `swapped`: whose KV sat in host memory during this step (swapped out, not yet back).
- `cut`: the victim for which the slo policy cut this step short mid-way. The whole step is
  rolled back (nothing was sampled; every request in `reqs` runs those tokens again later).
- `paused`: in the running set but given no tokens this step (budget spent, or paused by the
  slo policy for a more urgent waiter).
- `running`, `waiting`: queue lengths after planning; `kv_usage`: device pool share in use
  (0..1); `prefix_hits`: prompt tokens found in the prefix cache when this step admitted.
  The real engine's trace reads them at the same moment (right after planning, see
  timeline/tracer.py).
- `drained` (real engine only; true or absent): no request was left after the step's update,
  so the time to the next step's start was spent idling for arrivals.
- `phases` (real engine only): where the step's wall time went, seconds by phase, in the
  order they ran: `schedule` (the scheduler's plan), the runner's `prepare` (its request
  copies, swaps, the flattened batch), `forward`, `sample` (sampling and advancing its
  copies) -- or one `execute` for a runner that does not split --, `update` (the scheduler's
  update: stop rules, freeing) and `output` (output processing: detokenization, stop
  strings, RequestOutputs). Their sum is at most `duration`, which runs from the step's
  start to the end of its output processing. A cut step has no `sample` or `output`.
  Every key but `step`, `start`, `duration` and `reqs` is optional (empty / 0).

    {"type": "request", "id": "r3", "arrival": 0.70, "first_token": 0.83, "finished": 1.9,
     "ttft_slo_ms": 500, "prompt_len": 512, "output_len": 40, "preemptions": 1,
     "first_scheduled": 0.71}

  One per request when known (any key but `id` may be missing or null): the page draws the
  TTFT target as a marker at arrival + ttft_slo_ms and shows the rest on hover.

    {"type": "meta", "source": "simulator", "label": "slo policy"}

  Optional, once: what the trace is (shown as the panel's title). A real engine's trace
  (`source: "engine"`) adds its settings: model, path, dtype, device, threads, block_size,
  kv_bytes_per_token, max_model_len, num_gpu_blocks, max_num_batched_tokens (what
  `tokenweir calibrate --from-trace` builds a profile with). Its times are the engine's
  clock (time.monotonic); the Chrome form starts at the first arrival.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Optional

STEP_KEYS_REQUIRED = ("step", "start", "duration", "reqs")
ID_LISTS = ("preempted", "swapped", "cut", "paused")


class Trace:
    """One run's records: steps in order, requests by id, and the meta line."""

    def __init__(self, steps: list[dict], requests: Optional[dict[str, dict]] = None,
                 meta: Optional[dict] = None) -> None:
        self.steps = steps
        self.requests = requests or {}
        self.meta = meta or {}

    @property
    def label(self) -> str:
        return str(self.meta.get("label") or self.meta.get("source") or "trace")


def check_step(record: dict) -> None:
    """Raise ValueError naming the first thing wrong with a step record."""
    for key in STEP_KEYS_REQUIRED:
        if key not in record:
            raise ValueError(f"step record without {key!r}: {str(record)[:120]}")
    for r in record["reqs"]:
        if "id" not in r:
            raise ValueError(f"step {record['step']}: a request entry without 'id'")
    for key in ID_LISTS:
        if not isinstance(record.get(key, []), list):
            raise ValueError(f"step {record['step']}: {key!r} must be a list of ids")


def parse_lines(lines: Iterable[str]) -> Trace:
    steps: list[dict] = []
    requests: dict[str, dict] = {}
    meta: dict = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number}: not JSON ({e})") from None
        kind = obj.get("type", "step")
        if kind == "step":
            check_step(obj)
            steps.append(obj)
        elif kind == "request":
            obj.pop("type")
            requests[str(obj["id"])] = obj
        elif kind == "meta":
            obj.pop("type")
            meta.update(obj)
    steps.sort(key=lambda s: s["step"])
    return Trace(steps, requests, meta)


def load_jsonl(path: str | Path) -> Trace:
    with open(path) as f:
        return parse_lines(f)


def write_jsonl(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        if trace.meta:
            f.write(json.dumps({"type": "meta", **trace.meta}) + "\n")
        for r in trace.requests.values():
            f.write(json.dumps({"type": "request", **r}) + "\n")
        for s in trace.steps:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")


class StepRing:
    """The most recent `capacity` step records (what `/timeline` of a live server shows),
    and the request records of the requests they mention."""

    def __init__(self, capacity: int = 2000) -> None:
        self.steps: deque[dict] = deque(maxlen=capacity)
        self.requests: dict[str, dict] = {}
        self.num_dropped = 0  # steps pushed out of the ring so far
        # the engine thread adds while a server's event loop reads (trace()): one lock
        self._lock = threading.Lock()

    def add_step(self, record: dict) -> None:
        with self._lock:
            if len(self.steps) == self.steps.maxlen:
                self.num_dropped += 1
            self.steps.append(record)

    def add_request(self, record: dict) -> None:
        with self._lock:
            self.requests[str(record["id"])] = record
            if len(self.requests) > 4 * (self.steps.maxlen or 1):
                self._forget_old_requests()

    def _forget_old_requests(self) -> None:
        seen = {r["id"] for s in self.steps for r in s["reqs"]}
        self.requests = {k: v for k, v in self.requests.items() if k in seen}

    def trace(self, meta: Optional[dict[str, Any]] = None) -> Trace:
        meta = dict(meta or {})
        with self._lock:
            # copies: the recorder keeps updating a request record (first token, finish)
            steps, requests = list(self.steps), {k: dict(v) for k, v in self.requests.items()}
        if self.num_dropped:
            meta.setdefault("note", f"the ring kept the last {len(self.steps)} steps; "
                                    f"{self.num_dropped} older ones were dropped")
        return Trace(steps, requests, meta)
