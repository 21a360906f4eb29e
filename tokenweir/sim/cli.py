"""`tokenweir simulate`, `tokenweir sweep` and `tokenweir study`.

Wire into tokenweir/cli.py with `add_subcommands(sub)` in build_parser() and
`if args.command in SIM_COMMANDS: return run(args)` in main().
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import typing
from typing import Any, Optional

from tokenweir.config import CONFIG_CLASSES
from tokenweir.sim.hardware import HARDWARE_PROFILES, MODEL_SHAPES

SIM_COMMANDS = ("simulate", "sweep", "study")


def add_subcommands(subparsers) -> None:
    from tokenweir.cli import add_engine_args

    sim = subparsers.add_parser("simulate", help="simulate serving a workload on a virtual clock")
    _add_sim_args(sim)
    sim.add_argument("--chrome-trace", help="write a Chrome/Perfetto trace JSON here "
                     "(cluster runs: one process per instance)")
    sim.add_argument("--json", dest="json_out", help="write the metrics as JSON here")
    _add_cluster_args(sim)
    add_engine_args(sim)
    sweep = subparsers.add_parser("sweep", help="simulate a grid of config values in parallel")
    _add_sim_args(sweep)
    sweep.add_argument("--set", dest="sets", action="append", required=True,
                       metavar="FIELD=V1,V2,...", help="config field and values (repeatable: grid)")
    sweep.add_argument("--out", default="sweep.csv", help="CSV path (a PNG goes beside it "
                       "when matplotlib is installed)")
    sweep.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    add_engine_args(sweep)
    from tokenweir.sim.studies import add_study_parser
    add_study_parser(subparsers)


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    from tokenweir.sim.router import ROUTERS

    g = p.add_argument_group("cluster (any of these runs the cluster simulator)")
    g.add_argument("--num-instances", type=int, default=1, help="instances behind the router")
    g.add_argument("--router", default="round-robin", choices=ROUTERS)
    g.add_argument("--pp-size", type=int, default=1,
                   help="pipeline stages per instance: at most this many batches in flight")
    g.add_argument("--pd", default=None, metavar="P:D",
                   help="prefill/decode disaggregation: P prefill and D decode instances "
                   "(replaces --num-instances)")
    g.add_argument("--link-gbps", type=float, default=100.0,
                   help="KV-transfer link into each decode instance, Gbit/s")
    g.add_argument("--sessions", type=int, default=0,
                   help="multi-turn agentic sessions (replace the synthetic requests; they "
                   "start at --request-rate, first prompt --prompt-len, outputs --output-len)")
    g.add_argument("--turns", default="fixed:4", help="turns per session (length distribution)")
    g.add_argument("--turn-prompt-len", default="fixed:64",
                   help="new user tokens in each later turn")
    g.add_argument("--tool-delay-ms", default="fixed:500",
                   help="tool-call delay before each later turn, ms (length distribution)")


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--model-shape", default="llama-7b", choices=sorted(MODEL_SHAPES))
    g.add_argument("--hardware", default="h100", choices=sorted(HARDWARE_PROFILES))
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--profile", default=None, metavar="PATH",
                   help="step times from a fitted profile (tokenweir calibrate) instead of "
                   "the roofline of --model-shape/--hardware; single instance only")
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
            if _wants_cluster(args):
                return _simulate_cluster(args)
            return _simulate(args)
        if args.command == "study":
            from tokenweir.sim.studies import run_study
            return run_study(args)
        return _sweep(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from tokenweir.cli import engine_kwargs
    return engine_kwargs(args)


def _context_len(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """What synthetic lengths are capped to: --max-model-len, else the fitted profile's
    context length, else the model shape's."""
    from tokenweir.sim.hardware import get_shape

    fitted = _fitted_model(getattr(args, "profile", None))
    return (kwargs.get("max_model_len") or (fitted is not None and fitted.max_model_len)
            or get_shape(args.model_shape).max_position_embeddings)


def _workload(args: argparse.Namespace, kwargs: dict[str, Any]):
    from tokenweir.sim.workload import load_trace, save_trace, synthetic

    if args.trace:
        specs = load_trace(args.trace, default_prefix_len=args.prefix_len)
    else:
        max_len = _context_len(args, kwargs)
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
                  chrome_trace: Optional[str] = None, profile: Optional[str] = None) -> dict:
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.metrics import summarize
    from tokenweir.sim.trace import write_chrome_trace

    sim = build_simulation(kwargs, specs, model_shape, hardware, tp,
                           latency_model=_fitted_model(profile))
    result = sim.run()
    if chrome_trace:
        write_chrome_trace(result, chrome_trace)
    return summarize(result, ttft_slo_ms, tpot_slo_ms)


def _fitted_model(profile: Optional[str]):
    """The step-time model of a `tokenweir calibrate` profile, or None (the roofline)."""
    if not profile:
        return None
    from tokenweir.sim.calibrate import load_profile
    from tokenweir.sim.latency import FittedLatencyModel
    return FittedLatencyModel.from_profile(load_profile(profile))


def _where(args: argparse.Namespace) -> str:
    return (f"fitted profile {args.profile}" if args.profile
            else f"{args.model_shape} on {args.tp} x {args.hardware}")


def _simulate(args: argparse.Namespace) -> int:
    from tokenweir.sim.metrics import format_report

    kwargs = _engine_kwargs(args)
    specs = _workload(args, kwargs)
    metrics = simulate_once(kwargs, specs, args.model_shape, args.hardware, args.tp,
                            args.ttft_slo_ms, args.tpot_slo_ms, args.chrome_trace,
                            args.profile)
    print(f"--- tokenweir simulate: {_where(args)} ---")
    print(format_report(metrics))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


# ---- cluster -----------------------------------------------------------------------------
def _wants_cluster(args: argparse.Namespace) -> bool:
    return (args.num_instances != 1 or args.pp_size != 1 or bool(args.pd)
            or args.sessions > 0)


def _simulate_cluster(args: argparse.Namespace) -> int:
    from tokenweir.sim.cluster import (build_cluster, format_instance_table, parse_pd,
                                       summarize_cluster)
    from tokenweir.sim.metrics import format_report
    from tokenweir.sim.sessions import synthetic_sessions
    from tokenweir.sim.trace import write_cluster_chrome_trace

    kwargs = _engine_kwargs(args)
    sessions = None
    if args.sessions:
        sessions = synthetic_sessions(args.sessions, args.request_rate, kwargs.get("seed", 0),
                                      args.prompt_len, args.output_len, args.turns,
                                      args.turn_prompt_len, args.tool_delay_ms, args.arrival,
                                      args.cv, _context_len(args, kwargs))
        specs = []
    else:
        specs = _workload(args, kwargs)
    cluster = build_cluster(kwargs, specs, args.model_shape, args.hardware, args.tp,
                            args.pp_size, args.num_instances, args.router, parse_pd(args.pd),
                            args.link_gbps, sessions, _fitted_model(args.profile))
    result = cluster.run()
    if args.chrome_trace:  # one Perfetto process per instance
        write_cluster_chrome_trace(result, args.chrome_trace)
    metrics = summarize_cluster(result, args.ttft_slo_ms, args.tpot_slo_ms)
    layout = (f"PD {args.pd}" if args.pd else f"{args.num_instances} instance(s)")
    print(f"--- tokenweir simulate: {_where(args)}, {layout}, pp {args.pp_size}, "
          f"router {args.router} ---")
    print(format_report(metrics["overall"]))
    print("per instance:")
    print(format_instance_table(metrics["instances"]))
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
    kwargs, specs, model_shape, hardware, tp, ttft_slo, tpot_slo, profile = job
    return simulate_once(kwargs, specs, model_shape, hardware, tp, ttft_slo, tpot_slo,
                         profile=profile)


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
             args.tpot_slo_ms, args.profile) for p in points]
    from tokenweir.sim.plots import parallel_map, write_csv

    results = parallel_map(_sweep_point, jobs, args.jobs, "sweep")
    names = [name for name, _ in grid]
    rows = [{**{n: p[n] for n in names}, **m} for p, m in zip(points, results)]
    write_csv(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")
    for row in rows:
        print("  " + "  ".join(f"{n}={row[n]}" for n in names)
              + f"  throughput={row['request_throughput']:.2f} req/s"
              f"  ttft_p99={row['ttft_p99_ms']:.1f} ms  tpot_p50={row['tpot_p50_ms']:.2f} ms")
    png = _plot(rows, names, args.out)
    if png:
        print(f"wrote {png}")
    return 0


def _plot(rows: list[dict], names: list[str], csv_path: str) -> Optional[str]:
    """A PNG beside the CSV (metrics against the first grid field), or None without
    matplotlib."""
    try:
        from tokenweir.sim.plots import plot_sweep
        return plot_sweep(rows, names, csv_path.rsplit(".", 1)[0] + ".png")
    except ImportError:
        return None
