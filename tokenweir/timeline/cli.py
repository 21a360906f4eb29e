"""`tokenweir timeline TRACE [TRACE2] [-o page.html]` (the coordinator wires the subcommand)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from tokenweir.timeline.chrome import is_chrome_trace, load_chrome_trace
from tokenweir.timeline.layout import MAX_COLUMNS, MAX_ROWS
from tokenweir.timeline.page import build_page, load_trace
from tokenweir.timeline.records import write_jsonl


def make_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="tokenweir timeline",
        description="One self-contained HTML page showing which request ran what in each "
                    "step, from a step-record JSONL file or a simulator chrome trace "
                    "(--chrome-trace); two traces are shown side by side, rows aligned by "
                    "request id.")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="one or two traces")
    p.add_argument("-o", "--output", default="timeline.html", help="the page to write")
    p.add_argument("--title", default=None, help="page title")
    p.add_argument("--pid", type=int, default=None,
                   help="chrome trace of a cluster: the instance's process id (default: first)")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS,
                   help="requests shown; later arrivals are dropped (the page says so)")
    p.add_argument("--max-columns", type=int, default=MAX_COLUMNS,
                   help="columns; more steps are aggregated into buckets (the page says so)")
    p.add_argument("--write-records", default=None, metavar="JSONL",
                   help="also write the (first) trace as step records, e.g. to convert a "
                        "chrome trace")
    return p


def run(args: argparse.Namespace) -> int:
    if len(args.traces) > 2:
        raise SystemExit("tokenweir timeline: at most two traces side by side")
    traces = [load_chrome_trace(t, args.pid) if is_chrome_trace(t) else load_trace(t)
              for t in args.traces]
    for path, trace in zip(args.traces, traces):
        trace.meta["label"] = f"{Path(path).name} ({trace.label})"
    if args.write_records:
        write_jsonl(traces[0], args.write_records)
    out = build_page(traces, args.output, title=args.title, max_rows=args.max_rows,
                     max_columns=args.max_columns)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): "
          + ", ".join(f"{t.label}: {len(t.steps)} steps, {len(t.requests)} requests"
                      for t in traces))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return run(make_parser().parse_args(argv))
