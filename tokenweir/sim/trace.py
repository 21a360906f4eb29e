"""Chrome trace export (chrome://tracing, ui.perfetto.dev): steps as complete ('X') events on
one track, requests as async spans ('b'/'e') with queued / prefill / decode phases, and KV usage
and batch size as counters. Times are microseconds of virtual time.

A cluster run (`write_cluster_chrome_trace`) gives each instance its own process (pid =
instance index + 1, named by index and role) with the same tracks, and KV transfers of
prefill/decode disaggregation as spans on a track of the receiving instance. Request span ids
carry the instance index, so a request seen by two instances (a prefill and a decode) gives
two separate spans."""

from __future__ import annotations

import json
from typing import Optional

from tokenweir.sim.simulator import ClusterResult, SimResult

_PID = 1
_STEP_TID = 1
_TRANSFER_TID = 2
_US = 1e6


def chrome_trace_events(result: SimResult, max_requests: Optional[int] = 2000,
                        pid: int = _PID, process_name: str = "tokenweir sim",
                        id_prefix: str = "") -> list[dict]:
    """Events of one engine, as process `pid`; request span ids are `id_prefix` + request id."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process_name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": _STEP_TID,
         "args": {"name": "engine steps"}},
    ]
    for i, s in enumerate(result.steps):
        events.append({"ph": "X", "name": "step", "cat": "step", "pid": pid, "tid": _STEP_TID,
                       "ts": s.start * _US, "dur": s.seconds * _US,
                       "args": {"step": i, "reqs": s.num_reqs, "decodes": s.num_decode_reqs,
                                "tokens": s.num_tokens}})
        events.append({"ph": "C", "name": "kv_usage", "pid": pid, "ts": s.start * _US,
                       "args": {"usage": s.kv_usage}})
        events.append({"ph": "C", "name": "batch", "pid": pid, "ts": s.start * _US,
                       "args": {"running": s.num_running, "waiting": s.num_waiting}})
    requests = result.requests if max_requests is None else result.requests[:max_requests]
    for r in requests:
        if r.finished is None:
            continue
        phases = [("queued", r.arrival, r.first_scheduled or r.first_token),
                  ("prefill", r.first_scheduled or r.first_token, r.first_token),
                  ("decode", r.first_token, r.finished)]
        common = {"cat": "request", "pid": pid, "id": id_prefix + r.request_id}
        events.append({**common, "ph": "b", "name": r.request_id, "ts": r.arrival * _US,
                       "args": {"prompt_len": r.prompt_len, "output_len": r.num_output,
                                "priority": r.priority, "preemptions": r.num_preemptions}})
        for name, start, end in phases:
            events.append({**common, "ph": "b", "name": name, "ts": start * _US})
            events.append({**common, "ph": "e", "name": name, "ts": end * _US})
        events.append({**common, "ph": "e", "name": r.request_id, "ts": r.finished * _US})
    return events


def cluster_chrome_trace_events(result: ClusterResult,
                                max_requests: Optional[int] = 2000) -> list[dict]:
    """One process per instance (at most `max_requests` request spans each), in index order,
    and the KV transfers into each decode instance."""
    events: list[dict] = []
    for index, (instance, role) in enumerate(zip(result.instances, result.roles)):
        pid = index + 1
        events += chrome_trace_events(instance, max_requests, pid,
                                      f"instance {index} ({role})", f"{index}:")
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                       "args": {"sort_index": index}})
    receivers = sorted({t.decode for t in result.transfers})
    for index in receivers:
        events.append({"ph": "M", "name": "thread_name", "pid": index + 1,
                       "tid": _TRANSFER_TID, "args": {"name": "kv transfers in"}})
    for t in result.transfers:  # one link per receiver, FIFO: spans on its track never overlap
        events.append({"ph": "X", "name": t.request_id, "cat": "kv_transfer",
                       "pid": t.decode + 1, "tid": _TRANSFER_TID, "ts": t.start * _US,
                       "dur": (t.done - t.start) * _US,
                       "args": {"from_instance": t.prefill, "bytes": t.num_bytes,
                                "queued_ms": (t.start - t.ready) * 1000}})
    return events


def write_chrome_trace(result: SimResult, path: str, max_requests: Optional[int] = 2000) -> None:
    _write(chrome_trace_events(result, max_requests), path)


def write_cluster_chrome_trace(result: ClusterResult, path: str,
                               max_requests: Optional[int] = 2000) -> None:
    _write(cluster_chrome_trace_events(result, max_requests), path)


def _write(events: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
