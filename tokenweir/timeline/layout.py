"""From step records to what the page draws: per request a run-length list of cell states,
per column (a step, or a bucket of steps when there are too many) the series under the grid,
and an honest list of what was dropped or aggregated.

A row's runs are [first column, number of columns, state, tokens in the first column] with
states numbered as STATES; consecutive columns merge when state and tokens agree."""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from typing import Any, Optional

from tokenweir.config import TIMELINE_MAX_COLUMNS as MAX_COLUMNS
from tokenweir.config import TIMELINE_MAX_ROWS as MAX_ROWS
from tokenweir.timeline.records import Trace

# index = state code; the page uses the same table (sent with the data).
STATES = ["absent", "waiting", "paused", "prefill", "decode", "preempted", "swapped", "cut"]
COLORS = ["#ffffff", "#d9d9d9", "#f2b134", "#3b6fd4", "#3aa655", "#d62728", "#9467bd",
          "#e3008c"]
DESCRIPTIONS = [
    "not arrived or finished", "waiting in the queue", "running set, no tokens this step "
    "(budget spent or paused by the slo policy)", "prefill chunk (number: its tokens)",
    "decode", "preempted by recompute (KV dropped)", "swapped out (KV in host memory)",
    "step cut mid-way by the slo policy (tokens discarded)"]
WAITING, PAUSED, PREFILL, DECODE, PREEMPTED, SWAPPED, CUT = range(1, 8)
# which state wins a cell holding several (a bucket of steps, or a cut step's victim)
RANK = {0: 0, WAITING: 1, PAUSED: 2, SWAPPED: 3, DECODE: 4, PREFILL: 5, PREEMPTED: 6, CUT: 7}


def _cell_states(step: dict) -> dict[str, tuple[int, int]]:
    """request id -> (state, tokens) for one step record."""
    cells: dict[str, tuple[int, int]] = {}
    for rid in step.get("swapped", ()):
        cells[rid] = (SWAPPED, 0)
    for rid in step.get("paused", ()):
        cells[rid] = (PAUSED, 0)
    for r in step["reqs"]:
        prefill, decode = r.get("prefill", 0), r.get("decode", 0)
        cells[r["id"]] = (PREFILL if prefill else DECODE, prefill + decode)
    for rid in step.get("preempted", ()):
        cells[rid] = (PREEMPTED, 0)
    for rid in step.get("cut", ()):
        cells[rid] = (CUT, cells.get(rid, (0, 0))[1])
    return cells


def _merge(a: Optional[tuple[int, int]], b: tuple[int, int]) -> tuple[int, int]:
    if a is None:
        return b
    if a[0] == b[0]:
        return a[0], a[1] + b[1]
    return a if RANK[a[0]] > RANK[b[0]] else b


def _columns(steps: list[dict], bucket: int) -> tuple[dict[str, list], list[dict]]:
    """Series per column and cell states per column (each a dict id -> (state, tokens))."""
    n = math.ceil(len(steps) / bucket) if steps else 0
    series: dict[str, list] = {k: [0] * n for k in (
        "start", "dur", "step", "prefill", "decode", "running", "waiting", "kv", "hits")}
    cells: list[dict] = [{} for _ in range(n)]
    for i, s in enumerate(steps):
        c = i // bucket
        if i % bucket == 0:
            series["start"][c], series["step"][c] = round(s["start"], 6), s["step"]
        series["dur"][c] = round(series["dur"][c] + s["duration"], 7)
        for r in s["reqs"]:
            series["prefill"][c] += r.get("prefill", 0)
            series["decode"][c] += r.get("decode", 0)
        for key, src in (("running", "running"), ("waiting", "waiting"), ("kv", "kv_usage")):
            series[key][c] = max(series[key][c], s.get(src, 0) or 0)
        series["hits"][c] += s.get("prefix_hits", 0) or 0
        column = cells[c]
        for rid, cell in _cell_states(s).items():
            column[rid] = _merge(column.get(rid), cell) if bucket > 1 else cell
    return series, cells


def _runs(cols: dict[int, tuple[int, int]], first: int, last: int) -> list[list[int]]:
    """Run-length runs over columns first..last; gaps are waiting."""
    runs: list[list[int]] = []
    for c in range(first, last + 1):
        state, tokens = cols.get(c, (WAITING, 0))
        if runs and runs[-1][2] == state and runs[-1][3] == tokens \
                and runs[-1][0] + runs[-1][1] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1, state, tokens])
    return runs


def panel_model(trace: Trace, max_columns: int = MAX_COLUMNS) -> dict[str, Any]:
    """One trace as the page's panel: series, rows (id -> runs), requests, notes."""
    steps = trace.steps
    bucket = max(1, math.ceil(len(steps) / max_columns))
    series, cells = _columns(steps, bucket)
    by_row: dict[str, dict[int, tuple[int, int]]] = {}
    for c, column in enumerate(cells):
        for rid, cell in column.items():
            by_row.setdefault(rid, {})[c] = cell
    rows, requests = {}, {}
    starts = series["start"]
    for rid, cols in by_row.items():
        info = dict(trace.requests.get(rid, {"id": rid}))
        first = min(cols)
        if info.get("arrival") is not None:
            first = min(first, bisect_left(starts, info["arrival"]))
        rows[rid] = _runs(cols, first, max(cols))
        info["first_col"] = first
        requests[rid] = info
    notes = []
    if bucket > 1:
        notes.append(f"aggregated {len(steps)} steps into {len(series['start'])} columns of "
                     f"{bucket} steps (a cell shows the most telling state of its steps)")
    if trace.meta.get("note"):
        notes.append(str(trace.meta["note"]))
    return {"label": trace.label, "numSteps": len(steps), "bucket": bucket,
            "cols": series, "rows": rows, "requests": requests, "notes": notes,
            "estimated": any(r.get("estimated") for s in steps[:50] for r in s["reqs"])}


def natural_key(request_id: str) -> list:
    """Sort key reading runs of digits as numbers: r2 before r10 (text order puts r10 first).
    re.split with a group alternates text and digits, so two keys compare text with text and
    numbers with numbers."""
    return [int(part) if i % 2 else part
            for i, part in enumerate(re.split(r"(\d+)", request_id))]


# The page's row gutter fits about this many characters of its 10-px font; the JS clips any
# label to the gutter besides, so wide glyphs cannot spill over the bars either.
ROW_LABEL_CHARS = 10


def row_label(request_id: str, max_chars: int = ROW_LABEL_CHARS) -> str:
    """The id as the gutter shows it: whole when it fits, else its head and tail around an
    ellipsis (ids of one run often differ only at the end: cmpl-3f9a...-12 vs ...-13). The
    tooltip shows the whole id."""
    if len(request_id) <= max_chars:
        return request_id
    tail = (max_chars - 1) // 2 + 1
    return request_id[:max_chars - 1 - tail] + "\u2026" + request_id[-tail:]


def page_model(traces: list[Trace], max_rows: int = MAX_ROWS,
               max_columns: int = MAX_COLUMNS) -> dict[str, Any]:
    """Panels side by side, rows aligned by request id in order of first appearance (the
    first trace's arrival order, then the others'; ties in natural order of the ids); rows
    past `max_rows` are dropped."""
    panels = [panel_model(t, max_columns) for t in traces]
    order: dict[str, tuple] = {}
    for p_index, panel in enumerate(panels):
        for rid, info in panel["requests"].items():
            key = (info.get("arrival") if info.get("arrival") is not None
                   else panel["cols"]["start"][info["first_col"]], p_index)
            order.setdefault(rid, key)
    row_ids = sorted(order, key=lambda rid: (order[rid][1], order[rid][0], natural_key(rid)))
    if len(row_ids) > max_rows:
        dropped = len(row_ids) - max_rows
        row_ids = row_ids[:max_rows]
        kept = set(row_ids)
        for panel in panels:
            panel["rows"] = {k: v for k, v in panel["rows"].items() if k in kept}
            panel["requests"] = {k: v for k, v in panel["requests"].items() if k in kept}
            panel["notes"].append(f"dropped {dropped} requests (the latest to arrive): the "
                                  f"page shows the first {max_rows} rows")
    return {"rowIds": row_ids, "rowLabels": [row_label(rid) for rid in row_ids],
            "panels": panels, "states": STATES, "colors": COLORS,
            "descriptions": DESCRIPTIONS}
