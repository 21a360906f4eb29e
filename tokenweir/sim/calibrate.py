"""`tokenweir calibrate MODEL`: time the real model runner over a grid of step shapes, fit a
step-time model by least squares, and write it as a profile JSON for the simulator
(`tokenweir simulate --profile PATH`, `FittedLatencyModel`) and the slo policy's TTFT
predictor (`--slo-ttft-profile PATH`).

Each grid point is one engine step, built by hand and run through `ModelRunner.execute`
exactly as the engine runs it (one flattened forward, sampling included): optionally one
request computing `prefill_tokens` new tokens on `prefill_context` cached ones, plus
`decode_requests` requests computing one token each on `decode_context` cached ones. A point's
time is the median of `repeats` runs, taken in rounds over the whole grid (fresh request ids
each run; the KV content is scratch).

The fit: step seconds = sum of coefficient x feature over the features of
`tokenweir.sim.latency.fitted_features` (a constant, prefill tokens, decode rows, causal
attention pairs sum q * (c + (q + 1) / 2), prefill rows). Least squares on relative error
(each row weighted by 1 / its time, so a 50 ms step counts as much as a 2 s one), with every
coefficient kept >= 0 (a feature whose coefficient comes out negative is dropped and the rest
refitted). The TTFT line `predicted_ttft = a * uncached_prompt_tokens + c` is an ordinary
least-squares line through the prefill-only points with no cached context.

`--from-trace TRACE...` fits the same model, plus the engine's own per-step overhead as
terms of their own, to steps a real engine ran (sim/calibrate_trace.py documents the fit and
the keys it adds: "source", "overhead", "heldout"). A profile without "overhead" (every one
written before) loads as before: no overhead.

Written by hand, never by a fit: "runner_scale": {"decode": d, "prefill": p} multiplies the
runner time of decode-only steps by d and of steps with a prefill chunk by p (the machine
slower or faster than the one calibrated; `FittedLatencyModel`). Absent: 1.

Profile JSON (format "tokenweir-step-profile/1"); times in seconds:

    {
      "format": "tokenweir-step-profile/1",
      "model": "smollm2-135m", "path": "...", "dtype": "float32", "device": "cpu",
      "threads": 1,                      # torch intra-op threads during the timing
      "block_size": 16, "kv_bytes_per_token": 46080, "max_model_len": 8192,
      "num_layers": 30,                  # the model's; the simulator's mid-step cuts use it
      "features": ["const", "prefill_tokens", "decode_rows", "attention", "prefill_rows"],
      "coefficients": {"const": s, "prefill_tokens": s/token, "decode_rows": s/row,
                       "attention": s/pair, "prefill_rows": s/row},
      "fit": {"r2": ..., "mean_rel_error": ..., "max_rel_error": ..., "num_points": N},
      "ttft": {"a": s/token, "c": s, "r2": ...},
      "points": [{"prefill_tokens": P, "prefill_context": Cp, "decode_requests": D,
                  "decode_context": Cd, "seconds": measured, "predicted": fitted}, ...],
      "grid": "default" | "quick", "repeats": R, "calibration_seconds": wall time
    }
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from tokenweir.sim.latency import FITTED_FEATURES, FittedLatencyModel, StepTotals
# the fit lives in step_fit.py (calibrate_trace.py fits too); re-exported here
from tokenweir.sim.step_fit import PROFILE_FORMAT, Fit, fit_line, fit_step_model  # noqa: F401



@dataclass(frozen=True)
class GridPoint:
    prefill_tokens: int = 0  # one request computing this many new tokens (0: none)
    prefill_context: int = 0  # ... on this many cached tokens
    decode_requests: int = 0  # requests computing one token each
    decode_context: int = 0  # ... on this many cached tokens each

    def totals(self) -> StepTotals:
        chunks = [(1, self.decode_context)] * self.decode_requests
        if self.prefill_tokens:
            chunks.append((self.prefill_tokens, self.prefill_context))
        return StepTotals.of_chunks(chunks)

    @property
    def max_len(self) -> int:
        return max(self.prefill_context + self.prefill_tokens, self.decode_context + 1)


def default_grid() -> list[GridPoint]:
    """~40 points: prefill-only (with and without cached context), decode-only over batch
    sizes and contexts, and mixed steps. Under ~3 minutes for SmolLM2-135M, float32, on
    two AVX2 cores."""
    prefill = [GridPoint(p, c) for p in (8, 32, 64, 128, 256) for c in (0, 256)]
    decode = [GridPoint(0, 0, d, c) for d in (1, 2, 4, 8, 16, 32) for c in (32, 256, 768)]
    mixed = [GridPoint(p, 0, d, c) for p in (32, 128) for d in (4, 16) for c in (128, 512)]
    return prefill + decode + mixed


def quick_grid() -> list[GridPoint]:
    """9 points: enough for the 5 coefficients and the TTFT line (tests, smoke runs)."""
    return [GridPoint(16), GridPoint(48), GridPoint(96), GridPoint(32, 64),
            GridPoint(0, 0, 1, 32), GridPoint(0, 0, 4, 128), GridPoint(0, 0, 8, 32),
            GridPoint(48, 0, 4, 64), GridPoint(16, 0, 8, 128)]


GRIDS: dict[str, Callable[[], list[GridPoint]]] = {"default": default_grid, "quick": quick_grid}


# ---- timing (torch) ------------------------------------------------------------------------
class StepTimer:
    """Runs hand-built steps through a real ModelRunner and times `execute`."""

    def __init__(self, loaded, block_size: int, max_len: int, max_rows: int, dtype,
                 device) -> None:
        from tokenweir.runner.model_runner import ModelRunner

        self.block_size = block_size
        blocks_per_row = -(-(max_len + 1) // block_size)
        self.runner = ModelRunner(loaded.model, loaded.arch, 1 + max_rows * blocks_per_row,
                                  block_size, dtype, device, frozenset())
        self.vocab_size = loaded.arch.vocab_size
        self._step = 0
        self._previous: set[str] = set()

    def time(self, point: GridPoint) -> float:
        out = self._make_output(point)
        started = time.perf_counter()
        self.runner.execute(out)
        return time.perf_counter() - started

    def _make_output(self, point: GridPoint):
        from tokenweir.core.outputs import NewRequestData, SchedulerOutput
        from tokenweir.request import SamplingParams

        self._step += 1
        params = SamplingParams(temperature=0.0, max_tokens=1)
        reqs, counts, next_block = [], {}, 1

        def add(rid: str, context: int, new: int) -> None:
            nonlocal next_block
            n = context + new
            num_blocks = -(-n // self.block_size)
            tokens = [(7 + 31 * i + self._step) % self.vocab_size for i in range(n)]
            reqs.append(NewRequestData(rid, tokens, n, params,
                                       list(range(next_block, next_block + num_blocks)),
                                       context))
            counts[rid] = new
            next_block += num_blocks

        for j in range(point.decode_requests):
            add(f"d{self._step}-{j}", point.decode_context, 1)
        if point.prefill_tokens:
            add(f"p{self._step}", point.prefill_context, point.prefill_tokens)
        out = SchedulerOutput(reqs, counts, sum(counts.values()),
                              finished_req_ids=self._previous, step_id=self._step)
        self._previous = set(counts)  # the runner forgets them before the next step
        return out


def measure(timer: StepTimer, grid: Sequence[GridPoint], repeats: int,
            progress: Optional[Callable[[int, int, GridPoint, float], None]] = None
            ) -> list[float]:
    """Median seconds per point, over `repeats` rounds that each visit every point once (so a
    burst of load from other processes spreads over many points instead of skewing one).
    First, unrecorded, one step of each kind (prefill only, decode only, mixed): a kind's
    first step pays one-off set-up (seconds, not milliseconds)."""
    kinds: dict[tuple[bool, bool], GridPoint] = {}
    for point in grid:
        kinds.setdefault((point.prefill_tokens > 0, point.decode_requests > 0), point)
    for point in kinds.values():
        timer.time(point)
    samples: list[list[float]] = [[] for _ in grid]
    for round_index in range(repeats):
        for i, point in enumerate(grid):
            samples[i].append(timer.time(point))
            if progress and round_index == repeats - 1:
                progress(i + 1, len(grid), point, statistics.median(samples[i]))
    return [statistics.median(s) for s in samples]


def calibrate(model: str, grid: str = "default", repeats: int = 5, threads: int = 1,
              dtype: str = "float32", device: str = "cpu", block_size: int = 16,
              loaded=None, progress=None) -> dict:
    """Time `model` over the named grid and return the profile dict (see the module doc)."""
    import torch

    from tokenweir.engine.llm_engine import resolve_dtype
    from tokenweir.model.attention import kv_cache_bytes_per_block
    from tokenweir.model.loader import load_model

    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; known: {sorted(GRIDS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    started = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    loaded = loaded or load_model(model, torch_dtype, torch_device)
    points = GRIDS[grid]()
    too_long = [p for p in points if p.max_len > loaded.max_model_len]
    if too_long:
        raise ValueError(f"grid point {too_long[0]} exceeds the model's context length "
                         f"{loaded.max_model_len}")
    timer = StepTimer(loaded, block_size, max(p.max_len for p in points),
                      max(p.decode_requests + 1 for p in points), torch_dtype, torch_device)
    seconds = measure(timer, points, repeats, progress)
    return build_profile(points, seconds, {
        "model": model, "path": loaded.path, "dtype": str(torch_dtype).replace("torch.", ""),
        "device": str(torch_device), "threads": torch.get_num_threads(),
        "block_size": block_size,
        "kv_bytes_per_token": kv_cache_bytes_per_block(loaded.arch, block_size, torch_dtype)
        // block_size,
        "max_model_len": loaded.max_model_len, "num_layers": loaded.arch.num_layers,
        "grid": grid, "repeats": repeats,
        "calibration_seconds": round(time.perf_counter() - started, 2)})


def build_profile(points: Sequence[GridPoint], seconds: Sequence[float], meta: dict) -> dict:
    """Fit the step model and the TTFT line to measured points; the profile dict."""
    fit = fit_step_model([p.totals() for p in points], seconds)
    solo = [(p.prefill_tokens, s) for p, s in zip(points, seconds)
            if p.prefill_tokens and not p.prefill_context and not p.decode_requests]
    a, c, r2 = fit_line([x for x, _ in solo], [y for _, y in solo])
    return {
        "format": PROFILE_FORMAT, **meta,
        "features": list(FITTED_FEATURES),
        "coefficients": fit.coefficients,
        "fit": {"r2": fit.r2, "mean_rel_error": fit.mean_rel_error,
                "max_rel_error": fit.max_rel_error, "num_points": len(points)},
        "ttft": {"a": a, "c": c, "r2": r2},
        "points": [{**asdict(p), "seconds": s, "predicted": f}
                   for p, s, f in zip(points, seconds, fit.predicted)],
    }


def load_profile(path: str) -> dict:
    """Read and check a profile JSON; ValueError naming the problem."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not a {PROFILE_FORMAT} profile (write one with "
                         f"`tokenweir calibrate MODEL --out {path}`)")
    FittedLatencyModel.from_profile(data)  # validates the coefficients
    return data


def lowest_ttft(ttft: dict, longest: int) -> tuple[int, float]:
    """(prompt tokens, seconds): the TTFT line's lowest prediction a*n + b*n^2 + c over
    prompts of 1..longest tokens (an end, or the parabola's vertex where it lies between)."""
    a, b, c = ttft["a"], ttft.get("b", 0.0), ttft["c"]
    candidates = {1, max(1, longest)}
    if b > 0:
        vertex = -a / (2 * b)
        candidates |= {min(max(1, n), longest) for n in (math.floor(vertex), math.ceil(vertex))}
    n = min(candidates, key=lambda n: a * n + b * n * n + c)
    return n, a * n + b * n * n + c


def negative_ttft_warning(profile: dict) -> Optional[str]:
    """A line saying where the fitted TTFT line predicts a negative time, or None: such a line
    makes the slo policy think long prompts are free."""
    longest = int(profile.get("max_model_len") or 2048)
    n, seconds = lowest_ttft(profile["ttft"], longest)
    if seconds >= 0:
        return None
    return (f"the fitted TTFT line predicts {1000 * seconds:.1f} ms for a {n}-token prompt "
            f"(negative; c = {1000 * profile['ttft']['c']:.1f} ms): do not use this profile's "
            f"TTFT line (--slo-ttft-profile) as it is; calibrate over more varied steps or "
            f"give --slo-ttft-a-ms-per-token/--slo-ttft-c-ms")


def format_report(profile: dict) -> str:
    fit, ttft, coef = profile["fit"], profile["ttft"], profile["coefficients"]
    lines = [f"--- tokenweir calibrate: {profile['model']} ({profile['dtype']}, "
             f"{profile['device']}, {profile['threads']} thread(s)), {fit['num_points']} "
             f"points x {profile['repeats']} ---",
             "step seconds = " + " + ".join(f"{coef[f]:.4g}*{f}" for f in FITTED_FEATURES)
             + (" + few_rows[num_tokens]" if profile.get("few_rows") else ""),
             f"fit: R^2 {fit['r2']:.4f}, relative error mean {100 * fit['mean_rel_error']:.1f}% "
             f"max {100 * fit['max_rel_error']:.1f}%"
             + (f"; within {fit['num_windows']} windows of {fit['window_s']:g} s per run and "
                f"step kind (speed factors {fit['window_factor_min']:.2f}-"
                f"{fit['window_factor_max']:.2f}: calibrate_trace.fit_windows)"
                if fit.get("num_windows") else ""),
             f"TTFT line: {1000 * ttft['a']:.3f} ms/token * uncached prompt tokens + "
             + (f"{1e6 * ttft['b']:.4g} us/token^2 * tokens^2 + " if ttft.get("b") else "")
             + f"{1000 * ttft['c']:.1f} ms (R^2 {ttft['r2']:.4f})"]
    if ttft.get("warning"):
        lines.append(f"WARNING: {ttft['warning']}")
    if profile.get("few_rows"):
        lines.append("few_rows (ms, by tokens in the step): " + ", ".join(
            f"{n}: {1000 * s:+.2f}" for n, s in profile["few_rows"].items()))
    if profile.get("source") == "trace":
        from tokenweir.sim.calibrate_trace import format_heldout
        lines.append(format_heldout(profile))
    return "\n".join(lines)


# ---- command line (flags: config.CalibrateConfig) ------------------------------------
def run(args: argparse.Namespace) -> int:
    def progress(i: int, n: int, point: GridPoint, seconds: float) -> None:
        print(f"  [{i:2d}/{n}] prefill {point.prefill_tokens:4d} on {point.prefill_context:4d}"
              f"  decodes {point.decode_requests:3d} on {point.decode_context:4d}"
              f"  {1000 * seconds:9.1f} ms", file=sys.stderr, flush=True)

    try:
        if args.from_trace:
            from tokenweir.sim.calibrate_trace import calibrate_from_traces
            profile = calibrate_from_traces(args.from_trace, args.holdout_every,
                                            hinge_tokens=None)
        else:
            profile = calibrate(args.model, "quick" if args.quick else "default",
                                args.repeats, args.threads, args.dtype, args.device,
                                args.block_size, progress=progress)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    warning = negative_ttft_warning(profile)
    if warning:
        profile["ttft"]["warning"] = warning
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    print(format_report(profile))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0
