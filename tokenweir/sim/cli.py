"""What `tokenweir simulate`, `tokenweir sweep` and `tokenweir study` run, from the parsed
command line (tokenweir/cli builds the parser from the config dataclasses; this module never
imports it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import typing
from typing import Any, Optional

from tokenweir.config import CONFIG_CLASSES, engine_kwargs


def run(args: argparse.Namespace) -> int:
    try:
        _resolve_target(args)
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


def _resolve_target(args: argparse.Namespace) -> None:
    """Fold --model / --model-config into args.model_shape (a name or a config.json path,
    both of which `get_shape` reads) and --hardware-dtype into args.hardware ('NAME:DTYPE'),
    so everything downstream passes two strings. Checks them here: errors before any work."""
    from tokenweir.sim.hardware import get_hardware, get_shape

    if getattr(args, "model_config", None) and getattr(args, "model_name", None):
        raise ValueError("give --model or --model-config, not both")
    shape = getattr(args, "model_config", None) or getattr(args, "model_name", None)
    if shape:
        args.model_shape = shape
    if getattr(args, "hardware_dtype", None):
        args.hardware = f"{args.hardware}:{args.hardware_dtype}"
    get_shape(args.model_shape)
    get_hardware(args.hardware)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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
                  chrome_trace: Optional[str] = None, profile: Optional[str] = None,
                  step_records: Optional[str] = None) -> dict:
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.metrics import summarize
    from tokenweir.sim.trace import write_chrome_trace

    sim = build_simulation(kwargs, specs, model_shape, hardware, tp,
                           latency_model=_fitted_model(profile))
    result = _run_recording(sim, step_records) if step_records else sim.run()
    if chrome_trace:
        write_chrome_trace(result, chrome_trace)
    return summarize(result, ttft_slo_ms, tpot_slo_ms)


def _run_recording(sim, path: str):
    """sim.run(), its step records written to `path` (what `tokenweir timeline` reads)."""
    from tokenweir.timeline.recorder import record_simulation
    from tokenweir.timeline.records import write_jsonl

    result, trace = record_simulation(sim)
    write_jsonl(trace, path)
    return result


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
    if args.samples != 1:
        return _simulate_samples(args, kwargs)
    specs = _workload(args, kwargs)
    metrics = simulate_once(kwargs, specs, args.model_shape, args.hardware, args.tp,
                            args.ttft_slo_ms, args.tpot_slo_ms, args.chrome_trace,
                            args.profile, args.step_records)
    print(f"--- tokenweir simulate: {_where(args)} ---")
    print(format_report(metrics))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


# ---- draws of a noisy machine (--samples) --------------------------------------------------
SPREAD_METRICS = ("request_throughput", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                  "tpot_p90_ms", "preemptions")


def simulate_samples(kwargs: dict[str, Any], specs, profile: dict, count: int,
                     ttft_slo_ms: Optional[float], tpot_slo_ms: Optional[float]) -> list[dict]:
    """The metrics of `count` simulations of `specs`, each on one draw of the machine the
    profile measured (`latency.sample_machines`, seeded by the engine seed)."""
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.latency import sample_machines
    from tokenweir.sim.metrics import summarize

    return [summarize(build_simulation(kwargs, specs, latency_model=machine).run(),
                      ttft_slo_ms, tpot_slo_ms)
            for machine in sample_machines(profile, count, seed=kwargs.get("seed", 0))]


def mean_metrics(runs: list[dict]) -> dict:
    """Each numeric metric's mean over `runs`; other values from the first run."""
    import statistics

    out = {}
    for key, value in runs[0].items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        out[key] = statistics.fmean(r[key] for r in runs) if numeric else value
    return out


def _simulate_samples(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """--samples N: N draws of the --profile's machine, each metric's mean and spread."""
    from tokenweir.sim.calibrate import load_profile
    from tokenweir.sim.metrics import format_report

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if not args.profile:
        raise ValueError("--samples draws the machine a --profile measured: give --profile "
                         "(the roofline has no measured variability)")
    if args.chrome_trace:
        raise ValueError("--chrome-trace writes one run: give it without --samples")
    if args.step_records:
        raise ValueError("--step-records writes one run: give it without --samples")
    profile = load_profile(args.profile)
    variability = profile.get("variability") or {}
    if not (variability.get("run_sigma") or variability.get("step_sigma")):
        raise ValueError(f"{args.profile} measured no variability (profiles from `tokenweir "
                         f"calibrate --from-trace` do): --samples would repeat one run")
    specs = _workload(args, kwargs)
    runs = simulate_samples(kwargs, specs, profile, args.samples, args.ttft_slo_ms,
                            args.tpot_slo_ms)
    mean = mean_metrics(runs)
    print(f"--- tokenweir simulate: {_where(args)}, mean of {len(runs)} draws of its machine "
          f"(run to run {100 * variability.get('run_sigma', 0):.1f}%, step to step "
          f"{100 * variability.get('step_sigma', 0):.1f}%) ---")
    print(format_report(mean))
    print("spread over the draws (min .. max):")
    for key in SPREAD_METRICS:
        values = [r[key] for r in runs]
        print(f"  {key:26s} {min(values):,.4f} .. {max(values):,.4f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"mean": mean, "draws": runs}, f, indent=1)
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

    if getattr(args, "samples", 1) != 1:
        raise ValueError("--samples simulates one instance (no cluster options)")
    if getattr(args, "step_records", None):
        raise ValueError("--step-records records one instance (no cluster options; "
                         "--chrome-trace writes a cluster run)")
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
    from tokenweir.sim.ray_points import FailedPoint

    results = parallel_map(_sweep_point, jobs, args.jobs, "sweep", ray=getattr(args, "ray", None))
    names = [name for name, _ in grid]
    failed = [m for m in results if isinstance(m, FailedPoint)]
    rows = [{**{n: p[n] for n in names}, **m} for p, m in zip(points, results)
            if not isinstance(m, FailedPoint)]
    write_csv(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")
    for row in rows:
        print("  " + "  ".join(f"{n}={row[n]}" for n in names)
              + f"  throughput={row['request_throughput']:.2f} req/s"
              f"  ttft_p99={row['ttft_p99_ms']:.1f} ms  tpot_p50={row['tpot_p50_ms']:.2f} ms")
    png = _plot(rows, names, args.out)
    if png:
        print(f"wrote {png}")
    if failed:
        print(f"{len(failed)} of {len(points)} points failed (reported above)", file=sys.stderr)
    return 1 if failed else 0


def _plot(rows: list[dict], names: list[str], csv_path: str) -> Optional[str]:
    """A PNG beside the CSV (metrics against the first grid field), or None without
    matplotlib."""
    try:
        from tokenweir.sim.plots import plot_sweep
        return plot_sweep(rows, names, csv_path.rsplit(".", 1)[0] + ".png")
    except ImportError:
        return None
