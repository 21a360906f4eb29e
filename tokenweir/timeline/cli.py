"""What `tokenweir timeline TRACE [TRACE2] [-o page.html]` runs (flags: config.TimelineConfig)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenweir.timeline.chrome import is_chrome_trace, load_chrome_trace, write_chrome_traces
from tokenweir.timeline.page import build_page, load_trace
from tokenweir.timeline.records import write_jsonl


def run(args: argparse.Namespace) -> int:
    if len(args.traces) > 2:
        raise SystemExit("tokenweir timeline: at most two traces side by side")
    traces = [load_chrome_trace(t, args.pid) if is_chrome_trace(t) else load_trace(t)
              for t in args.traces]
    for path, trace in zip(args.traces, traces):
        trace.meta["label"] = f"{Path(path).name} ({trace.label})"
    if args.write_records:
        write_jsonl(traces[0], args.write_records)
    if args.write_chrome:
        write_chrome_traces(traces, args.write_chrome)
    out = build_page(traces, args.output, title=args.title, max_rows=args.max_rows,
                     max_columns=args.max_columns)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): "
          + ", ".join(f"{t.label}: {len(t.steps)} steps, {len(t.requests)} requests"
                      for t in traces))
    return 0
