"""`tokenweir study frontier | pool | policies`: canned simulator studies. Each writes
<out-dir>/<study>.csv and <study>.png and prints its table. Defaults: a 7B-class shape
(llama-7b) on one H100, so each runs in seconds to a minute.

- frontier: a long prompt (30,000 tokens) arrives among steady decodes; one point per chunk
  size (long_prefill_token_threshold = chunk, budget = chunk + one token per decode). Plots the
  long prompt's TTFT against the p99 inter-token latency the other requests see while it
  prefills (gaps ending between its arrival and its first token: the interference the chunk
  size trades). Larger chunks: lower TTFT, higher ITL.
- pool: a fixed workload over a range of KV pool sizes (num_gpu_blocks_override), admission
  without full-sequence reservation: total steps and preemptions against blocks (the hockey
  stick: below some size, preemption and recompute blow up).
- policies: victim policy (fcfs / priority / cost) x preemption mode (recompute / swap / auto)
  on one memory-pressured workload with two priority classes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from tokenweir.sim.metrics import percentile
from tokenweir.sim.plots import (format_table, parallel_map, plot_grouped_bars, plot_xy,
                                 write_csv)
from tokenweir.sim.ray_points import failures, succeeded
from tokenweir.sim.workload import RequestSpec, synthetic

STUDIES = ("frontier", "pool", "policies")


def run_study(args: argparse.Namespace) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    failed: list = []
    rows, columns, png = {"frontier": frontier, "pool": pool,
                          "policies": policies}[args.study](args, failed)
    csv_path = os.path.join(args.out_dir, f"{args.study}.csv")
    write_csv(rows, csv_path)
    print(f"--- tokenweir study {args.study}: {args.model_shape} on {args.tp} x {args.hardware} ---")
    print(format_table(rows, columns))
    print(f"wrote {csv_path}")
    print(f"wrote {png}")
    if failed:  # each failure was reported as it happened (sim/ray_points.py)
        print(f"{len(failed)} points failed (reported above)", file=sys.stderr)
    return 1 if failed else 0


def _run_points(fn, jobs: list, args: argparse.Namespace, desc: str, failed: list) -> list:
    """The rows of the points that succeeded; the failed ones (only --ray keeps going past a
    failure) are appended to `failed`."""
    results = parallel_map(fn, jobs, args.jobs, desc, ray=getattr(args, "ray", None))
    failed.extend(failures(results))
    return succeeded(results)


def _png(args: argparse.Namespace) -> str:
    return os.path.join(args.out_dir, f"{args.study}.png")


# ---- frontier ----------------------------------------------------------------------------
def frontier_specs(args: argparse.Namespace) -> list[RequestSpec]:
    specs = [RequestSpec(f"d{i}", 0.0, args.decode_prompt, args.decode_output, index=i)
             for i in range(args.num_decodes)]
    specs.append(RequestSpec("long", args.long_arrival, args.long_prompt, 16,
                             index=args.num_decodes))
    return specs


def frontier_point(job: tuple) -> dict:
    from tokenweir.sim.cluster import build_cluster

    chunk, args, specs = job
    kwargs = {"max_num_batched_tokens": chunk + args.num_decodes,
              "long_prefill_token_threshold": chunk, "enable_prefix_caching": False,
              "max_model_len": max(args.long_prompt + 16, args.decode_prompt + args.decode_output)}
    cluster = build_cluster(kwargs, specs, args.model_shape, args.hardware, args.tp,
                            record_itl_times=True)
    result = cluster.run()
    inst = cluster.instances[0]
    long = inst.records["long"]
    window = [gap for gap, t, rid in zip(inst.itl, inst.itl_times, inst.itl_ids)
              if rid != "long" and long.arrival < t <= long.first_token]
    others = sorted(gap for gap, rid in zip(inst.itl, inst.itl_ids) if rid != "long")
    if not window or any(r.finished <= long.first_token
                         for r in result.overall.requests if r.request_id != "long"):
        raise ValueError(f"chunk {chunk}: the decodes did not outlast the long prompt's "
                         f"prefill; raise --decode-output")
    window.sort()
    return {"chunk": chunk, "long_ttft_ms": (long.first_token - long.arrival) * 1000,
            "itl_p99_ms": percentile(window, 99) * 1000,
            "itl_max_ms": window[-1] * 1000,
            "itl_p50_ms": percentile(window, 50) * 1000,
            "itl_p99_all_ms": percentile(others, 99) * 1000,
            "prefill_steps": sum(1 for s in result.overall.steps
                                 if long.arrival <= s.start < long.first_token)}


def frontier(args: argparse.Namespace, failed: list) -> tuple[list[dict], list[str], str]:
    specs = frontier_specs(args)
    jobs = [(c, args, specs) for c in sorted(args.chunks)]
    rows = _run_points(frontier_point, jobs, args, "frontier", failed)
    png = plot_xy(rows, "itl_p99_ms", ["long_ttft_ms"], _png(args),
                  f"{args.long_prompt}-token prompt among {args.num_decodes} decodes "
                  f"(labels: chunk size)", annotate="chunk")
    return rows, list(rows[0]), png


# ---- pool --------------------------------------------------------------------------------
def _workload(args: argparse.Namespace, **kw: Any) -> tuple[list[RequestSpec], int]:
    """The study's seeded workload and a max_model_len that just holds its longest request."""
    specs = synthetic(args.num_requests, args.request_rate, seed=args.seed,
                      prompt=args.prompt_len, output=args.output_len, max_model_len=8192, **kw)
    return specs, max(s.prompt_len + s.output_len for s in specs)


def _blocks_needed(specs: list[RequestSpec], block_size: int = 16) -> tuple[int, int]:
    """(blocks for the longest request, blocks for every request at once), null included."""
    per = [-(-(s.prompt_len + s.output_len) // block_size) for s in specs]
    return max(per) + 1, sum(per) + 1


def _sim_point(job: tuple) -> dict:
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.metrics import summarize

    label, kwargs, specs, model_shape, hardware, tp = job
    sim = build_simulation(kwargs, specs, model_shape, hardware, tp)
    result = sim.run()
    m = summarize(result)
    stats = result.stats
    high = sorted(r.finished - r.arrival for r in result.requests if r.priority == 0)
    return {**label, "num_steps": m["num_steps"], "preemptions": m["preemptions"],
            "swapped_out": stats.num_swapped_out, "recompute_tax": m["recompute_tax"],
            "sim_seconds": m["sim_seconds"], "request_throughput": m["request_throughput"],
            "ttft_p99_ms": m["ttft_p99_ms"], "e2e_p99_ms": m["e2e_p99_ms"],
            "e2e_p99_prio0_ms": percentile(high, 99) * 1000 if high else math.nan}


def default_pool_grid(smallest: int, roomy: int, points: int = 10) -> list[int]:
    """`points` sizes spaced geometrically from `smallest` to `roomy`, distinct, ascending."""
    if roomy <= smallest:
        return [smallest]
    ratio = (roomy / smallest) ** (1 / (points - 1))
    return sorted({int(round(smallest * ratio ** k)) for k in range(points)})


def pool(args: argparse.Namespace, failed: list) -> tuple[list[dict], list[str], str]:
    specs, max_len = _workload(args)
    smallest, roomy = _blocks_needed(specs)
    grid = args.blocks or default_pool_grid(smallest, roomy)
    base = {"max_model_len": max_len, "enable_prefix_caching": False,
            "scheduler_reserve_full_isl": False}
    jobs = [({"blocks": b}, {**base, "num_gpu_blocks_override": b}, specs, args.model_shape,
             args.hardware, args.tp) for b in grid]
    rows = _run_points(_sim_point, jobs, args, "pool", failed)
    png = plot_xy(rows, "blocks", ["num_steps", "preemptions", "sim_seconds"], _png(args),
                  f"{args.num_requests} requests, pool size sweep", logx=True)
    columns = ["blocks", "num_steps", "preemptions", "recompute_tax", "sim_seconds",
               "request_throughput"]
    return rows, columns, png


# ---- policies ----------------------------------------------------------------------------
VICTIMS = ("fcfs", "priority", "cost")
MODES = ("recompute", "swap", "auto")


def policies(args: argparse.Namespace, failed: list) -> tuple[list[dict], list[str], str]:
    specs, max_len = _workload(args, priority_mix=args.priority_mix)
    smallest, roomy = _blocks_needed(specs)
    blocks = args.blocks or max(smallest, roomy // 16)
    base = {"max_model_len": max_len, "enable_prefix_caching": False,
            "scheduler_reserve_full_isl": False, "num_gpu_blocks_override": blocks}
    jobs = [({"victim": v, "mode": m},
             {**base, "preemption_policy": v, "preemption_mode": m}, specs,
             args.model_shape, args.hardware, args.tp) for v in VICTIMS for m in MODES]
    rows = _run_points(_sim_point, jobs, args, "policies", failed)
    png = plot_grouped_bars(rows, "victim", "mode",
                            ["preemptions", "recompute_tax", "e2e_p99_ms", "e2e_p99_prio0_ms"],
                            _png(args), f"{args.num_requests} requests, {blocks} KV blocks")
    columns = ["victim", "mode", "preemptions", "swapped_out", "recompute_tax",
               "request_throughput", "ttft_p99_ms", "e2e_p99_ms", "e2e_p99_prio0_ms"]
    return rows, columns, png
