"""`tokenweir simulate` and `tokenweir sweep`.

Wire into tokenweir/cli.py with `add_subcommands(sub)` in build_parser() and
`if args.command in SIM_COMMANDS: return run(args)` in main().
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import math
import multiprocessing
import sys
import typing
from typing import Any, Optional

from tokenweir.config import CONFIG_CLASSES
from tokenweir.sim.hardware import HARDWARE_PROFILES, MODEL_SHAPES

SIM_COMMANDS = ("simulate", "sweep")


def add_subcommands(subparsers) -> None:
    from tokenweir.cli import add_engine_args

    sim = subparsers.add_parser("simulate", help="simulate serving a workload on a virtual clock")
    _add_sim_args(sim)
    sim.add_argument("--chrome-trace", help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument("--json", dest="json_out", help="write the metrics as JSON here")
    add_engine_args(sim)
    sweep = subparsers.add_parser("sweep", help="simulate a grid of config values in parallel")
    _add_sim_args(sweep)
    sweep.add_argument("--set", dest="sets", action="append", required=True,
                       metavar="FIELD=V1,V2,...", help="config field and values (repeatable: grid)")
    sweep.add_argument("--out", default="sweep.csv", help="CSV path (a PNG goes beside it "
                       "when matplotlib is installed)")
    sweep.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    add_engine_args(sweep)


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--model-shape", default="llama-7b", choices=sorted(MODEL_SHAPES))
    g.add_argument("--hardware", default="h100", choices=sorted(HARDWARE_PROFILES))
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--num-requests", type=int, default=1000)
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at 0)")
    g.add_argument("--arrival", default="poisson", choices=("poisson", "gamma"))
    g.add_argument("--cv", type=float, default=1.0, help="gamma inter-arrival coefficient of variation")
    g.add_argument("--prompt-len", default="lognormal:256:0.8",
                   help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="lognormal:128:0.8")
    g.add_argument("--num-prefix-groups", type=int, default=0)
    g.add_argument("--prefix-len", type=int, default=0, help="tokens shared within a group")
    g.add_argument("--priority-mix", default=None, help="PRIO:WEIGHT,... e.g. 0:0.8,1:0.2")
    g.add_argument("--trace", help="JSONL workload (arrival, prompt_len, output_len, priority, "
                   "ttft_slo_ms, prefix_group); replaces the synthetic one")
    g.add_argument("--save-trace", help="write the workload as JSONL here")
    g.add_argument("--ttft-slo-ms", type=float, default=None)
    g.add_argument("--tpot-slo-ms", type=float, default=None)


def run(args: argparse.Namespace) -> int:
    try:
        if args.command == "simulate":
            return _simulate(args)
        return _sweep(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from tokenweir.cli import engine_kwargs
    return engine_kwargs(args)


def _workload(args: argparse.Namespace, kwargs: dict[str, Any]):
    from tokenweir.sim.hardware import get_shape
    from tokenweir.sim.workload import load_trace, save_trace, synthetic

    if args.trace:
        specs = load_trace(args.trace, default_prefix_len=args.prefix_len)
    else:
        max_len = kwargs.get("max_model_len") or get_shape(args.model_shape).max_position_embeddings
        specs = synthetic(args.num_requests, args.request_rate, seed=kwargs.get("seed", 0),
                          prompt=args.prompt_len, output=args.output_len, arrival=args.arrival,
                          cv=args.cv, num_prefix_groups=args.num_prefix_groups,
                          prefix_len=args.prefix_len, priority_mix=args.priority_mix,
                          max_model_len=max_len)
    if args.save_trace:
        save_trace(specs, args.save_trace)
    return specs


def simulate_once(kwargs: dict[str, Any], specs, model_shape: str, hardware: str, tp: int,
                  ttft_slo_ms: Optional[float], tpot_slo_ms: Optional[float],
                  chrome_trace: Optional[str] = None) -> dict:
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.metrics import summarize
    from tokenweir.sim.trace import write_chrome_trace

    sim = build_simulation(kwargs, specs, model_shape, hardware, tp)
    result = sim.run()
    if chrome_trace:
        write_chrome_trace(result, chrome_trace)
    return summarize(result, ttft_slo_ms, tpot_slo_ms)


def _simulate(args: argparse.Namespace) -> int:
    from tokenweir.sim.metrics import format_report

    kwargs = _engine_kwargs(args)
    specs = _workload(args, kwargs)
    metrics = simulate_once(kwargs, specs, args.model_shape, args.hardware, args.tp,
                            args.ttft_slo_ms, args.tpot_slo_ms, args.chrome_trace)
    print(f"--- tokenweir simulate: {args.model_shape} on {args.tp} x {args.hardware} ---")
    print(format_report(metrics))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


# ---- sweep -------------------------------------------------------------------------------
def parse_sets(sets: list[str]) -> list[tuple[str, list[Any]]]:
    """['max_num_batched_tokens=256,512'] -> [('max_num_batched_tokens', [256, 512])], values
    converted to the config field's type."""
    fields = {f.name: (f, owner) for owner in CONFIG_CLASSES for f in dataclasses.fields(owner)}
    grid = []
    for item in sets:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values:
            raise ValueError(f"bad --set {item!r}: use FIELD=V1,V2,...")
        if name not in fields:
            raise ValueError(f"bad --set {item!r}: unknown config field {name!r}")
        field, owner = fields[name]
        grid.append((name, [_convert(v.strip(), field, owner) for v in values.split(",")]))
    return grid


def _convert(text: str, field: dataclasses.Field, owner: type) -> Any:
    hint = typing.get_type_hints(owner)[field.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = kinds[0]
    if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{field.name}: expected a boolean, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{field.name}: expected {kind.__name__}, got {text!r}") from None


def _sweep_point(job: tuple) -> dict:
    kwargs, specs, model_shape, hardware, tp, ttft_slo, tpot_slo = job
    return simulate_once(kwargs, specs, model_shape, hardware, tp, ttft_slo, tpot_slo)


def sweep_points(grid: list[tuple[str, list[Any]]], base: dict[str, Any]) -> list[dict]:
    names = [name for name, _ in grid]
    return [{**base, **dict(zip(names, combo))}
            for combo in itertools.product(*(values for _, values in grid))]


def _sweep(args: argparse.Namespace) -> int:
    grid = parse_sets(args.sets)
    base = _engine_kwargs(args)
    specs = _workload(args, base)
    points = sweep_points(grid, base)
    jobs = [(p, specs, args.model_shape, args.hardware, args.tp, args.ttft_slo_ms,
             args.tpot_slo_ms) for p in points]
    processes = args.jobs or multiprocessing.cpu_count()
    if processes > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(min(processes, len(jobs))) as pool:
            results = pool.map(_sweep_point, jobs)
    else:
        results = [_sweep_point(j) for j in jobs]
    names = [name for name, _ in grid]
    rows = [{**{n: p[n] for n in names}, **m} for p, m in zip(points, results)]
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    for row in rows:
        print("  " + "  ".join(f"{n}={row[n]}" for n in names)
              + f"  throughput={row['request_throughput']:.2f} req/s"
              f"  ttft_p99={row['ttft_p99_ms']:.1f} ms  tpot_p50={row['tpot_p50_ms']:.2f} ms")
    png = _plot(rows, names[0], args.out)
    if png:
        print(f"wrote {png}")
    return 0


def _plot(rows: list[dict], x: str, csv_path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = ("request_throughput", "ttft_p99_ms", "tpot_p50_ms", "preemptions")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
    for ax, metric in zip(axes, metrics):
        ax.plot([str(r[x]) for r in rows], [r[metric] for r in rows], marker="o")
        ax.set_xlabel(x)
        ax.set_title(metric)
    fig.tight_layout()
    path = csv_path.rsplit(".", 1)[0] + ".png"
    fig.savefig(path)
    plt.close(fig)
    return path
