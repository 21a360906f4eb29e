"""Chrome trace export (chrome://tracing, ui.perfetto.dev): steps as complete ('X') events on
one track, requests as async spans ('b'/'e') with queued / prefill / decode phases, and KV usage
and batch size as counters. Times are microseconds of virtual time."""

from __future__ import annotations

import json
from typing import Optional

from tokenweir.sim.simulator import SimResult

_PID = 1
_STEP_TID = 1


def chrome_trace_events(result: SimResult, max_requests: Optional[int] = 2000) -> list[dict]:
    us = 1e6
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": _PID, "args": {"name": "tokenweir sim"}},
        {"ph": "M", "name": "thread_name", "pid": _PID, "tid": _STEP_TID,
         "args": {"name": "engine steps"}},
    ]
    for i, s in enumerate(result.steps):
        events.append({"ph": "X", "name": "step", "cat": "step", "pid": _PID, "tid": _STEP_TID,
                       "ts": s.start * us, "dur": s.seconds * us,
                       "args": {"step": i, "reqs": s.num_reqs, "decodes": s.num_decode_reqs,
                                "tokens": s.num_tokens}})
        events.append({"ph": "C", "name": "kv_usage", "pid": _PID, "ts": s.start * us,
                       "args": {"usage": s.kv_usage}})
        events.append({"ph": "C", "name": "batch", "pid": _PID, "ts": s.start * us,
                       "args": {"running": s.num_running, "waiting": s.num_waiting}})
    requests = result.requests if max_requests is None else result.requests[:max_requests]
    for r in requests:
        if r.finished is None:
            continue
        phases = [("queued", r.arrival, r.first_scheduled or r.first_token),
                  ("prefill", r.first_scheduled or r.first_token, r.first_token),
                  ("decode", r.first_token, r.finished)]
        common = {"cat": "request", "pid": _PID, "id": r.request_id}
        events.append({**common, "ph": "b", "name": r.request_id, "ts": r.arrival * us,
                       "args": {"prompt_len": r.prompt_len, "output_len": r.num_output,
                                "priority": r.priority, "preemptions": r.num_preemptions}})
        for name, start, end in phases:
            events.append({**common, "ph": "b", "name": name, "ts": start * us})
            events.append({**common, "ph": "e", "name": name, "ts": end * us})
        events.append({**common, "ph": "e", "name": r.request_id, "ts": r.finished * us})
    return events


def write_chrome_trace(result: SimResult, path: str, max_requests: Optional[int] = 2000) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_trace_events(result, max_requests),
                   "displayTimeUnit": "ms"}, f)
