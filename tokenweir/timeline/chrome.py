"""Convert the simulator's chrome trace (tokenweir/sim/trace.py) into step records.

What the chrome trace holds: steps as 'X' events (args step, reqs, decodes, tokens), counters
kv_usage and batch (running, waiting) at each step's start, and per request async spans: the
request itself (args prompt_len, output_len, preemptions), then "queued", "prefill",
"decode". It does not say which request ran how many tokens in which step, so this converter
derives it, and marks every derived entry `estimated: true`:

- a request is in a step when the step starts inside its prefill span (a prefill entry) or
  its decode span (a decode entry of 1 token); before that, from its arrival, it waits;
- the step's prefill tokens (tokens - decodes) are shared evenly by its prefilling requests.

Preemptions, swaps, pauses and cuts inside a span are invisible in a chrome trace; the
request lines keep each request's preemption count. A cluster trace has one process per
instance: `pid` picks one (default: the first with steps).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from pathlib import Path
from typing import Optional

from tokenweir.timeline.records import Trace

_US = 1e6


def is_chrome_trace(path: str | Path) -> bool:
    with open(path) as f:
        head = f.read(64).lstrip()
    return head.startswith("{") and '"traceEvents"' in head or head.startswith("[")


def load_chrome_trace(path: str | Path, pid: Optional[int] = None) -> Trace:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return convert_events(events, pid)


def convert_events(events: list[dict], pid: Optional[int] = None) -> Trace:
    if pid is None:
        pids = sorted({e.get("pid", 1) for e in events if e.get("cat") == "step"})
        pid = pids[0] if pids else 1
    mine = [e for e in events if e.get("pid", 1) == pid]
    steps = _steps(mine)
    spans = _request_spans(mine)
    _place_requests(steps, spans)
    requests = {rid: _request_line(rid, s) for rid, s in spans.items()}
    name = next((e["args"]["name"] for e in mine
                 if e.get("ph") == "M" and e.get("name") == "process_name"), "chrome trace")
    return Trace(steps, requests, {"source": "chrome-trace", "label": name, "pid": pid})


def _steps(events: list[dict]) -> list[dict]:
    counters: dict[float, dict] = {}
    for e in events:
        if e.get("ph") == "C":
            counters.setdefault(e["ts"], {}).update(e.get("args", {}))
    xs = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "step"),
                key=lambda e: e["ts"])
    steps = []
    for i, e in enumerate(xs):
        args, c = e.get("args", {}), counters.get(e["ts"], {})
        steps.append({"step": args.get("step", i), "start": e["ts"] / _US,
                      "duration": e.get("dur", 0) / _US, "reqs": [],
                      "_tokens": args.get("tokens", 0), "_decodes": args.get("decodes", 0),
                      "running": c.get("running", 0), "waiting": c.get("waiting", 0),
                      "kv_usage": c.get("usage", 0.0)})
    return steps


def _request_spans(events: list[dict]) -> dict[str, dict]:
    """request id -> {arrival, finished, args, queued/prefill/decode: [start, end]} (s)."""
    spans: dict[str, dict] = {}
    by_span_id: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "request" or e.get("ph") not in ("b", "e"):
            continue
        ts = e["ts"] / _US
        if e["name"] in ("queued", "prefill", "decode"):
            rid = by_span_id.get(e["id"])
            if rid is not None:
                spans[rid].setdefault(e["name"], [ts, ts])[0 if e["ph"] == "b" else 1] = ts
        elif e["ph"] == "b":
            by_span_id[e["id"]] = e["name"]
            spans[e["name"]] = {"arrival": ts, "finished": None, "args": e.get("args", {})}
        elif e["name"] in spans:
            spans[e["name"]]["finished"] = ts
    return spans


def _place_requests(steps: list[dict], spans: dict[str, dict]) -> None:
    starts = [s["start"] for s in steps]
    prefilling: list[list[str]] = [[] for _ in steps]
    for rid, span in spans.items():
        a, b = span.get("prefill", (0.0, 0.0))
        for i in range(bisect_left(starts, a), bisect_left(starts, b)):
            prefilling[i].append(rid)
        a, b = span.get("decode", (0.0, 0.0))
        for i in range(bisect_left(starts, a), bisect_left(starts, b)):
            steps[i]["reqs"].append({"id": rid, "prefill": 0, "decode": 1, "estimated": True})
    for step, ids in zip(steps, prefilling):
        tokens = max(0, step.pop("_tokens") - step.pop("_decodes"))
        share, extra = divmod(tokens, len(ids)) if ids else (0, 0)
        step["reqs"][:0] = [{"id": rid, "prefill": share + (k < extra), "decode": 0,
                             "estimated": True} for k, rid in enumerate(ids)]


def _request_line(rid: str, span: dict) -> dict:
    args = span["args"]
    return {"id": rid, "arrival": span["arrival"],
            "first_token": span.get("decode", [None])[0], "finished": span["finished"],
            "prompt_len": args.get("prompt_len"), "output_len": args.get("output_len"),
            "preemptions": args.get("preemptions"), "priority": args.get("priority")}


# ---- step records -> chrome trace (the real engine's --trace, and side-by-side files) ------
PHASE_ORDER = ("schedule", "prepare", "execute", "forward", "sample", "update", "output")


def records_to_chrome_events(trace: Trace, pid: int = 1,
                             process_name: Optional[str] = None) -> list[dict]:
    """The events the simulator's chrome trace has (sim/trace.py: steps on one track, KV
    usage and batch counters, request spans queued / prefill / decode), plus each step's
    phases as slices nested in it, in the order they ran. Times start at the run's first
    arrival or step (an engine's clock reads seconds since boot). Loads back with
    convert_events."""
    name = process_name or trace.label
    origin = min([s["start"] for s in trace.steps[:1]]
                 + [r["arrival"] for r in trace.requests.values()
                    if r.get("arrival") is not None], default=0.0)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "engine steps"}}]
    for s in trace.steps:
        events += _step_events(s, pid, origin)
    for rid, r in trace.requests.items():
        events += _request_events(rid, r, pid, origin)
    return events


def _step_events(s: dict, pid: int, origin: float) -> list[dict]:
    ts = (s["start"] - origin) * _US
    decodes = sum(1 for r in s["reqs"] if r.get("decode"))
    tokens = sum(r.get("prefill", 0) + r.get("decode", 0) for r in s["reqs"])
    events = [{"ph": "X", "name": "step", "cat": "step", "pid": pid, "tid": 1, "ts": ts,
               "dur": s["duration"] * _US,
               "args": {"step": s["step"], "reqs": len(s["reqs"]), "decodes": decodes,
                        "tokens": tokens, "preempted": s.get("preempted", []),
                        "swapped": s.get("swapped", []), "cut": s.get("cut", []),
                        "prefix_hits": s.get("prefix_hits", 0)}},
              {"ph": "C", "name": "kv_usage", "pid": pid, "ts": ts,
               "args": {"usage": s.get("kv_usage", 0.0)}},
              {"ph": "C", "name": "batch", "pid": pid, "ts": ts,
               "args": {"running": s.get("running", 0), "waiting": s.get("waiting", 0)}}]
    at = ts
    phases = s.get("phases", {})
    for phase in sorted(phases, key=lambda p: PHASE_ORDER.index(p) if p in PHASE_ORDER else 99):
        dur = phases[phase] * _US
        events.append({"ph": "X", "name": phase, "cat": "phase", "pid": pid, "tid": 1,
                       "ts": at, "dur": dur})
        at += dur
    return events


def _request_events(rid: str, r: dict, pid: int, origin: float) -> list[dict]:
    arrival, finished = r.get("arrival"), r.get("finished")
    if arrival is None or finished is None:
        return []
    arrival, finished = arrival - origin, finished - origin
    first_token = r["first_token"] - origin if r.get("first_token") is not None else finished
    scheduled = (r["first_scheduled"] - origin if r.get("first_scheduled") is not None
                 else first_token)
    common = {"cat": "request", "pid": pid, "id": f"{pid}:{rid}"}
    events = [{**common, "ph": "b", "name": rid, "ts": arrival * _US,
               "args": {"prompt_len": r.get("prompt_len"), "output_len": r.get("output_len"),
                        "priority": r.get("priority"), "preemptions": r.get("preemptions")}}]
    for name, start, end in (("queued", arrival, scheduled), ("prefill", scheduled, first_token),
                             ("decode", first_token, finished)):
        events += [{**common, "ph": "b", "name": name, "ts": start * _US},
                   {**common, "ph": "e", "name": name, "ts": end * _US}]
    events.append({**common, "ph": "e", "name": rid, "ts": finished * _US})
    return events


def write_chrome_from_records(records_path: str | Path, chrome_path: str | Path) -> Path:
    """The Chrome/Perfetto form of a step-record JSONL file."""
    from tokenweir.timeline.records import load_jsonl

    return write_chrome_traces([load_jsonl(records_path)], chrome_path)


def write_chrome_traces(traces: list[Trace], path: str | Path) -> Path:
    """One chrome trace JSON of one or more runs, one process each (pid 1, 2, ...): a real
    run and its simulation open side by side in Perfetto."""
    events: list[dict] = []
    for pid, trace in enumerate(traces, 1):
        events += records_to_chrome_events(trace, pid)
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                       "args": {"sort_index": pid}})
    path = Path(path)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
