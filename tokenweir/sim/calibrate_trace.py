"""`tokenweir calibrate --from-trace TRACE...`: fit the step-time model to steps a real engine
ran (`--trace FILE` on `tokenweir generate` / `serve` / `LLM`; format: timeline/records.py).

Per traced step (cut steps and steps without phase times are skipped):
- the runner's seconds: the sum of its phases `prepare`, `forward`, `sample` (or `execute`);
- the cycle: the step's duration (schedule ... output processing) plus the gap to the next
  step's start, the gap capped at GAP_CAP_S (a longer gap is the process descheduled; a short
  one is the engine loop's own cost), and no gap at all after a step that left the engine
  drained (`idle_after`: it then idled for arrivals, which the simulator's event loop
  models itself);
- the engine overhead: cycle - runner.

Two fits, each non-negative least squares: the runner's time on `fitted_features` (each
step's residual divided by the square root of its time: RUNNER_WEIGHT_POWER; the time the
model predicts for it, after RUNNER_REWEIGHT_ROUNDS of reweighting; within windows since
fid6: one free speed factor per run, FIT_WINDOW_S window and step kind, so that the machine's
drift between windows does not set the shape: `fit_runner`), the overhead on
`overhead_features` (a constant, per request, per decode request; absolute error: it is a
fraction of a millisecond). Stalls are left out of both fits and of the held-out steps
(`find_stalls`: a step whose runner time is STALL_LOCAL_RATIO times its same-kind neighbours',
or whose engine overhead exceeds STALL_OVERHEAD_S: the process was descheduled, no step shape
explains it), found with the fitted model and the fits redone until none is new. Every
`holdout_every`-th step is held out of both fits; the report gives the fitted model's error on
those steps: per step (mean, p90) and on their summed time (what a run's total time sees).
The runner's time also gets a `few_rows` table (latency.FEW_ROWS_MAX): per count of tokens in a
step of few rows, what the kernels' choice by row count adds to the linear model
(`fit_with_few_rows`; held-out step error on the fidelity suite's traces 3.2% -> 2.7%, p90
6.7% -> 5.2%).

The profile is calibrate.py's format with, in addition:
    "source": "trace", "traces": [paths], "num_steps": N,
    "few_rows": {"<num_tokens>": s} (counts seen often enough in two runs or more:
                                      `fit_few_rows`; one trace gives no table),
    "fit": {..., "window_s": s, "num_windows": n, "window_factor_min": f,
            "window_factor_max": f} (the fit within windows: `fit_runner`),
    "overhead_features": [...], "overhead": {"const": s, "requests": s/req,
                                             "decode_requests": s/req},
    "heldout": {"num_steps": n, "mean_rel_error": e, "p90_rel_error": e,
                "total_rel_error": e (signed: predicted sum / measured sum - 1),
                "runner_mean_rel_error": e, "overhead_mean_ms": ms, "overhead_mean_ms_fit": ms,
                "local_mean_rel_error": e (the runner's error against its neighbours:
                                           `local_ratios`, the machine's drift divided out)},
    "machine_speed": [per trace: machine_speed(...)] (measured / fitted runner time per step
                     kind, over the run and its range over windows: the machine's drift),
    "stalls": {"num_steps": n, "seconds": s (their measured cycle time)},
    "variability": {"step_sigma": s, "run_sigma": s, "num_steps": n, "num_run_kinds": n,
                    "drift_sigma": s, "drift_tau_s": s, "num_windows": n,
                    "kinds": {kind: {"run_sigma", "step_sigma", "drift_sigma", "num_runs",
                                     "num_steps", "num_windows"}},
                    "kind_run_rho": r, "kind_drift_rho": r}
                   (log-space scatter of step times around the model: `variability`; per
                   step kind: `with_drift`),
    "forward_phases": {"pre_s", "sample_const_s", "sample_per_row_s", "post_s", "num_steps"}
                      (where the forward lies in a step, for the slo cut's layer boundaries:
                      sim/forward_phases.py; null for traces without phases),
and the TTFT predictor (a, b, c: quadratic) fitted to the model's own solo-TTFT curve (no
hand-built grid points).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tokenweir.sim.forward_phases import fit_forward_phases
from tokenweir.sim.latency import (FEW_ROWS_MAX, FITTED_FEATURES, OVERHEAD_FEATURES,
                                  STEP_KINDS, FittedLatencyModel, StepTotals,
                                  overhead_features, step_kind)
from tokenweir.timeline.records import Trace, load_jsonl
from tokenweir.timeline.tracer import RUNNER_PHASES

GAP_CAP_S = 0.002
# The runner fit's weighting (calibrate.fit_step_model): relative error (1, the grid's choice)
# lets the many short decode steps of a real run outweigh its few long prefill steps.
# Measured on the fidelity suite's traces (AVX-512 machine, float32, calibrated on seed 0,
# validated on seed 1, `sim_fidelity.py --replay`), residuals scaled by MEASURED times: summed
# held-out time -6.3% at 1, -4.1% at 0.5, -1.4% at 0 (absolute). Most of that was not the
# power but the measured time in the divisor (a stalled step weighs less because it stalled):
# scaled by the PREDICTED time (RUNNER_REWEIGHT_ROUNDS of reweighting), -1.4% at 1 and at 0.5,
# and the fit reproduces its own steps' summed time (100.0%, was 97.3%).
RUNNER_WEIGHT_POWER = 0.5
RUNNER_REWEIGHT_ROUNDS = 3  # converged after 2 on the suite's traces
META_KEYS = ("model", "path", "dtype", "device", "threads", "block_size",
             "kv_bytes_per_token", "max_model_len", "num_layers")


@dataclass(frozen=True)
class TracedStep:
    totals: StepTotals
    runner: float  # seconds in the model runner
    cycle: float  # seconds from this step's start to the next one's (gap capped)
    start: float = 0.0  # the step's start on the trace's clock (seconds)

    @property
    def overhead(self) -> float:
        return self.cycle - self.runner


def traced_steps(trace: Trace) -> list[TracedStep]:
    """The fittable steps of one trace (see the module doc)."""
    steps, out = trace.steps, []
    for i, s in enumerate(steps):
        phases = s.get("phases")
        if s.get("cut") or not s["reqs"] or not phases:
            continue
        chunks = [(r["prefill"] + r["decode"], r["context"] - r["prefill"] - r["decode"])
                  for r in s["reqs"]]
        runner = sum(phases.get(k, 0.0) for k in RUNNER_PHASES)
        cycle = s["duration"]
        if i + 1 < len(steps) and not idle_after(s):
            gap = steps[i + 1]["start"] - (s["start"] + s["duration"])
            cycle += min(max(gap, 0.0), GAP_CAP_S)
        if runner > 0:
            out.append(TracedStep(StepTotals.of_chunks(chunks), runner, cycle, s["start"]))
    return out


def idle_after(step: dict) -> bool:
    """Whether the engine had no request left after `step`'s update: the trace says so
    (`drained`), or, in a trace written before that key, the queues it read after the update
    were empty (a trace that reads them as planned never has both empty: the step ran a
    request)."""
    return bool(step.get("drained")) or (step.get("running", 1) == 0
                                         and step.get("waiting", 1) == 0)


# ---- machine drift ---------------------------------------------------------------------------
# On the shared machines the fidelity suite runs on, one step shape runs at different speeds in
# different stretches of a run: in the suite's traces (issue 16), decode steps ran 0.79x to
# 1.8x the fitted time over 3-second windows (memory-bound: they read every weight), steps
# with a prefill chunk 0.9x to 1.25x (compute-bound). No step-shape term can predict it; these
# measure it, so that a run's error can be told apart from the model's.
SPEED_WINDOW_S = 3.0
MIN_WINDOW_STEPS = 5  # a window with fewer steps of a kind gives that kind no ratio
LOCAL_NEIGHBOURS = 6  # same-kind steps on each side that set a step's local speed


def speed_windows(model: FittedLatencyModel, steps: Sequence[TracedStep],
                  window_s: float = SPEED_WINDOW_S) -> dict[str, list[float]]:
    """Per kind, in time order, one ratio per window of `window_s` seconds (counted from the
    first step's start) holding at least MIN_WINDOW_STEPS steps of that kind: the window's
    measured runner seconds over the model's, summed over those steps."""
    sums: dict[tuple[str, int], list[float]] = {}
    t0 = steps[0].start if steps else 0.0
    for s in steps:
        acc = sums.setdefault((step_kind(s.totals), int((s.start - t0) // window_s)),
                              [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += s.runner
        acc[2] += model.runner_seconds(s.totals)
    out: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
    for (kind, _), (n, real, predicted) in sorted(sums.items(), key=lambda kv: kv[0][1]):
        if n >= MIN_WINDOW_STEPS and predicted > 0:
            out[kind].append(real / predicted)
    return out


def machine_speed(model: FittedLatencyModel, steps: Sequence[TracedStep],
                  window_s: float = SPEED_WINDOW_S) -> dict[str, dict]:
    """Per kind with steps: {"num_steps", "ratio": measured runner seconds over the model's
    summed over the run, "min", "max": over its windows (`speed_windows`; the run's ratio when
    no window has enough steps)}."""
    windows = speed_windows(model, steps, window_s)
    out = {}
    for kind in STEP_KINDS:
        mine = [s for s in steps if step_kind(s.totals) == kind]
        predicted = sum(model.runner_seconds(s.totals) for s in mine)
        if not mine or predicted <= 0:
            continue
        ratio = sum(s.runner for s in mine) / predicted
        out[kind] = {"num_steps": len(mine), "ratio": ratio,
                     "min": min(windows[kind], default=ratio),
                     "max": max(windows[kind], default=ratio)}
    return out


def local_ratios(model: FittedLatencyModel, steps: Sequence[TracedStep],
                 neighbours: int = LOCAL_NEIGHBOURS) -> list[Optional[float]]:
    """Per step of one run: its measured/predicted runner ratio over the median ratio of the
    `neighbours` nearest steps of its kind on each side (None with fewer than 3 of them). The
    machine's slow drift divides out; what is left is the model's error between shapes that
    run near each other in time, plus step-to-step jitter."""
    predicted = [model.runner_seconds(s.totals) for s in steps]
    ratios = [s.runner / p if p > 0 else 0.0 for s, p in zip(steps, predicted)]
    out: list[Optional[float]] = [None] * len(steps)
    for kind in STEP_KINDS:
        where = [i for i, s in enumerate(steps) if step_kind(s.totals) == kind and ratios[i]]
        mine = [ratios[i] for i in where]
        for p, i in enumerate(where):
            around = mine[max(0, p - neighbours):p] + mine[p + 1:p + 1 + neighbours]
            if len(around) >= 3:
                out[i] = mine[p] / statistics.median(around)
    return out


# A shared machine sometimes deschedules the engine for a second or more in one step (issue 16's
# kept traces: 1.2-s decode steps among 15-ms ones, two or three per run when another job
# starts). One such step outweighs hundreds of ordinary ones in a least-squares fit (a fit with
# them: R^2 0.15, every coefficient off by 2x). The ordinary jitter of the suite's traces stays
# below 3.5x the neighbours' median.
STALL_LOCAL_RATIO = 4.0
STALL_OVERHEAD_S = 0.05  # the engine's own per-step work is ~0.4 ms
STALL_ROUNDS = 4
# The few-rows table (`fit_few_rows`): a count needs FEW_ROWS_MIN_STEPS fitted steps to get an
# entry, FEW_ROWS_MIN_RUN_STEPS in each of FEW_ROWS_MIN_RUNS runs; the linear fit and the table
# are fitted alternately FEW_ROWS_ROUNDS rounds (on the fidelity suite's traces 4, 8 and 16
# rounds gave the table of 2 within 0.01 ms).
FEW_ROWS_MIN_STEPS = 10
FEW_ROWS_MIN_RUNS = 2
FEW_ROWS_MIN_RUN_STEPS = 3
FEW_ROWS_ROUNDS = 2
# fid15: the table as fitted on fid14's calibration runs alternated +-5 ms (6 rows +3.75, 7
# rows -5.56, 8 rows +5.27) and none of it came back in the validation runs (per count, each
# run's median residual with the run's speed divided out: -2.2, -0.2, -1.7 ms). Its cause:
# a run's speed multiplies a whole ~50-ms step (a run 10% slow is +5 ms at every count) and
# each count is seen in its own few runs. So each run's residuals are taken with its speed
# for the step kind divided out (FEW_ROWS_RUN_SPEED: measured over the linear model's
# runner time, over the run's steps of that kind), and an entry within FEW_ROWS_NOISE_SE
# standard errors (its runs' medians' scatter: 1.2533 sd / sqrt(runs)) of the table's
# weighted median pools into it, so detrending leaves it 0: the linear model's (issue 36,
# fid15; False / 0: as before).
FEW_ROWS_RUN_SPEED = True
FEW_ROWS_NOISE_SE = 2.0


def variability(model: FittedLatencyModel, per_trace: Sequence[Sequence[TracedStep]],
                stalled: Sequence[Sequence[bool]]) -> dict:
    """How much the machine's step times scatter around the fitted model, in log space (the
    simulator's `latency.sample_machines` draws from it):

    - "step_sigma": step to step, the machine's drift divided out: 1.4826 x the median
      absolute log of the steps' local ratios (`local_ratios`; a robust standard deviation,
      blind to the rare stall). It also holds the model's error between shapes that run near
      each other, so it is an upper bound of the jitter alone.
    - "run_sigma": run to run: the root mean square of the log of each run's measured/modelled
      runner time, per step kind with MIN_WINDOW_STEPS steps in the run (0 with fewer than 3
      such (run, kind) pairs). The fit was made on these runs, so it is a lower bound of what
      a new run sees.

    Stalls (`stalled`, per trace per step) count in neither."""
    logs: list[float] = []
    run_logs: list[float] = []
    for steps, flags in zip(per_trace, stalled):
        kept = [s for s, f in zip(steps, flags) if not f]
        logs += [math.log(r) for r in local_ratios(model, kept) if r]
        for kind in STEP_KINDS:
            mine = [s for s in kept if step_kind(s.totals) == kind]
            predicted = sum(model.runner_seconds(s.totals) for s in mine)
            if len(mine) >= MIN_WINDOW_STEPS and predicted > 0:
                run_logs.append(math.log(sum(s.runner for s in mine) / predicted))
    step_sigma = 1.4826 * statistics.median(abs(x) for x in logs) if logs else 0.0
    run_sigma = (math.sqrt(statistics.fmean(x * x for x in run_logs))
                 if len(run_logs) >= 3 else 0.0)
    return {"step_sigma": step_sigma, "run_sigma": run_sigma, "num_steps": len(logs),
            "num_run_kinds": len(run_logs)}


def with_drift(model: FittedLatencyModel, per_trace: Sequence[Sequence[TracedStep]],
               stalled: Sequence[Sequence[bool]],
               holds: Optional[Sequence[int]] = None) -> dict:
    """`variability`, the drift inside runs (`drift.fit_drift`: "drift_sigma",
    "drift_tau_s", "num_windows") and the same per step kind (`drift.fit_kind_law`: "kinds",
    "kind_run_rho", "kind_drift_rho"; fid15), stalls left out of all. With `holds` (per
    trace, its hold: `run_holds`) each kind's "hold_sigma" too (fid16) and "num_holds"."""
    from tokenweir.sim.drift import fit_drift, fit_kind_law

    v = variability(model, per_trace, stalled)
    kept = [[s for s, f in zip(steps, flags) if not f] for steps, flags in zip(per_trace, stalled)]
    step_logs: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
    for steps in kept:
        for s, r in zip(steps, local_ratios(model, steps)):
            if r:
                step_logs[step_kind(s.totals)].append(math.log(r))
    extra = {} if holds is None else {"num_holds": len(set(holds))}
    return {**v, **fit_drift(model, kept, step_kind, v["step_sigma"]),
            **fit_kind_law(model, kept, step_kind, step_logs, holds=holds), **extra}


def refit_holds(profile: dict, paths: Sequence[str],
                recorded: Optional[Sequence[Optional[str]]] = None) -> dict:
    """`profile` with each kind's hold part (`drift.fit_hold_split`) refitted over its own
    calibration traces (profile["traces"]) and the runs at `paths` (more runs of the same
    machine, collected in holds of their own: `recorded`, per path, the hold its collector
    recorded), each run's log speed against the profile's model, stalls left out; each kind's
    hold sigma capped at its run sigma (the profile's: a run alone draws as before). The
    step model and every other sigma are the profile's."""
    from tokenweir.sim.drift import fit_hold_split, kind_run_logs

    model = FittedLatencyModel.from_profile(profile)
    own = list(profile.get("traces") or [])
    per_trace = []
    for path in own + list(paths):
        steps = traced_steps(load_jsonl(path))
        per_trace.append([s for s, f in zip(steps, find_stalls(model, steps)) if not f])
    holds = run_holds(per_trace, [None] * len(own) + list(recorded or [None] * len(paths)))
    split = fit_hold_split([kind_run_logs(model, t, step_kind) for t in per_trace], holds)
    v = dict(profile["variability"])
    v["kinds"] = {k: {**law, "hold_sigma": min(law["run_sigma"], split[k])}
                  for k, law in v["kinds"].items()}
    return {**profile, "variability": {**v, "num_holds": len(set(holds)),
                                       "hold_runs": list(map(str, paths))}}


def run_holds(per_trace: Sequence[Sequence[TracedStep]],
              recorded: Optional[Sequence[Optional[str]]] = None) -> list[int]:
    """Per trace, its hold (`drift.infer_holds`: runs of one collecting invocation within
    HOLD_SPAN_S of each other share the machine's speed): from the traces' step clocks and, where
    given, the hold each run's collector recorded (`recorded`, per trace; None: none)."""
    from tokenweir.sim.drift import RunStamp, infer_holds

    recorded = list(recorded) if recorded is not None else [None] * len(per_trace)
    stamps = [RunStamp(steps[0].start, steps[-1].start + steps[-1].cycle, hold)
              if steps else RunStamp(math.inf, math.inf, hold)
              for steps, hold in zip(per_trace, recorded)]
    return infer_holds(stamps)


def find_stalls(model: FittedLatencyModel, steps: Sequence[TracedStep]) -> list[bool]:
    """Per step of one run: True for a stall (see STALL_LOCAL_RATIO, STALL_OVERHEAD_S)."""
    local = local_ratios(model, steps)
    return [(r is not None and r > STALL_LOCAL_RATIO) or s.overhead > STALL_OVERHEAD_S
            for s, r in zip(steps, local)]


def fit_overhead(totals: Sequence[StepTotals], seconds: Sequence[float]) -> dict[str, float]:
    """Non-negative least squares (absolute error) of the overhead on overhead_features."""
    import numpy as np

    x = np.array([overhead_features(t) for t in totals], dtype=float)
    y = np.array(seconds, dtype=float)
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return {f: float(c) for f, c in zip(OVERHEAD_FEATURES, coef)}


def split(steps: list, holdout_every: int) -> tuple[list, list]:
    """(fit, held out): every holdout_every-th item is held out (0: none)."""
    if holdout_every <= 1:
        return steps, []
    held = [s for i, s in enumerate(steps) if i % holdout_every == holdout_every - 1]
    return [s for i, s in enumerate(steps) if i % holdout_every != holdout_every - 1], held


def heldout_errors(model: FittedLatencyModel, held: list[TracedStep],
                   local: Sequence[Optional[float]] = ()) -> dict:
    """The model's errors on the held-out steps; `local`: their local ratios (`local_ratios`,
    None where a step has too few neighbours), summarised as "local_mean_rel_error"."""
    if not held:
        return {"num_steps": 0}
    predicted = [model.predict_totals(s.totals) for s in held]
    rel = sorted(abs(p - s.cycle) / s.cycle for p, s in zip(predicted, held))
    runner_rel = [abs(model.runner_seconds(s.totals) - s.runner) / s.runner for s in held]
    return {"num_steps": len(held), "mean_rel_error": statistics.fmean(rel),
            "p90_rel_error": rel[int(0.9 * (len(rel) - 1))],
            "total_rel_error": sum(predicted) / sum(s.cycle for s in held) - 1.0,
            "runner_mean_rel_error": statistics.fmean(runner_rel),
            "overhead_mean_ms": 1000 * statistics.fmean(s.overhead for s in held),
            "overhead_mean_ms_fit": 1000 * statistics.fmean(
                model.overhead_seconds(s.totals) for s in held),
            **_local_summary(local)}


def _local_summary(local: Sequence[Optional[float]]) -> dict:
    known = [r for r in local if r is not None]
    return {"local_mean_rel_error": statistics.fmean(abs(r - 1.0) for r in known)} \
        if known else {}


# The runner fit: one speed factor per run, window of FIT_WINDOW_S seconds and step kind
# (step_fit.fit_within_windows: the machine's drift between windows does not set the shape;
# per kind because decode steps (memory-bound) and prefill steps (compute-bound) drift apart:
# speed_windows; each kind keeps its summed time, its level). fid6, issue 36, on fid5's suite
# (ten calibration runs): decode attention 0.56 -> 2.74 us per context token (physically it
# reads 46 KB of float32 KV per token: 2.7 us at the 17 GB/s one thread streams); held-out
# step error 9.49% -> 9.48%; the 27 validation runs' decode steps of the prefix workload
# (3,000-token contexts) 1.20x -> 1.16x the profile, the other workloads' within 1.5 points of
# before. The term is weakly identified by two runs per workload: windows of 0.5-6 s put it
# at 1.5-7.6 us on the plain runner times; none near the plain fit's 0.56.
# WINDOW_FIT False: one fit over all steps, as before fid6 (the same profile, bit for bit).
WINDOW_FIT = True
FIT_WINDOW_S = SPEED_WINDOW_S


def fit_windows(per_trace: Sequence[Sequence[TracedStep]],
                window_s: float) -> list[tuple[int, int, str]]:
    """Per step of every trace, in order: (trace, window, kind), its window of `window_s`
    seconds counted from the trace's first step's start (wall clock: what drifts is the
    machine) and its step kind."""
    out = []
    for k, steps in enumerate(per_trace):
        t0 = steps[0].start if steps else 0.0
        out += [(k, int((s.start - t0) // window_s), step_kind(s.totals)) for s in steps]
    return out


def fit_runner(steps: Sequence[TracedStep], windows: Sequence, targets=None,
               hinge_tokens: int = 0):
    """The runner model fitted to `steps` (their runner seconds, or `targets`): a
    step_fit.WindowFit, each step kind keeping its summed time (its level), with one window
    for all when WINDOW_FIT is off; `hinge_tokens`: the decode-context hinge's knee (0:
    none)."""
    from tokenweir.sim.step_fit import fit_within_windows

    seconds = [s.runner for s in steps] if targets is None else targets
    return fit_within_windows([s.totals for s in steps], seconds,
                              windows if WINDOW_FIT else [0] * len(steps),
                              RUNNER_WEIGHT_POWER, RUNNER_REWEIGHT_ROUNDS,
                              [step_kind(s.totals) for s in steps], hinge_tokens)


def calibrate_from_traces(paths: Sequence[str], holdout_every: int = 5,
                          hinge_tokens: Optional[int] = 0,
                          holds: Optional[Sequence[Optional[str]]] = None) -> dict:
    """The profile dict fitted to the traces at `paths` (see the module doc), with the
    decode-context hinge at `hinge_tokens` (0: none; None: the knee `choose_hinge` picks, what
    `calibrate --from-trace` and the fidelity suite do: six fits instead of one). `holds`:
    per path the hold its collector recorded, if any (`run_holds`; else inferred)."""
    started = time.perf_counter()
    traces = [load_jsonl(p) for p in paths]
    if hinge_tokens is not None:
        profile = _fit_profile(traces, paths, holdout_every, hinge_tokens, holds)
    else:
        profile = choose_hinge(lambda knee: _fit_profile(traces, paths, holdout_every, knee,
                                                         holds))
    profile["calibration_seconds"] = round(time.perf_counter() - started, 2)
    return profile


def _fit_profile(traces: list[Trace], paths: Sequence[str], holdout_every: int,
                 hinge_tokens: int, holds: Optional[Sequence[Optional[str]]] = None) -> dict:
    """`calibrate_from_traces` with the hinge's knee given."""
    from tokenweir.sim.step_fit import PROFILE_FORMAT

    meta = _common_meta(traces, paths)
    per_trace = [traced_steps(t) for t in traces]
    steps = [s for t in per_trace for s in t]
    all_fit, all_held = split(list(range(len(steps))), holdout_every)
    windows = fit_windows(per_trace, FIT_WINDOW_S)
    stalled = [False] * len(steps)
    for _ in range(STALL_ROUNDS):
        fit_steps = [steps[i] for i in all_fit if not stalled[i]]
        if len(fit_steps) < len(FITTED_FEATURES) + len(OVERHEAD_FEATURES):
            raise ValueError(f"{len(fit_steps)} fittable steps in {list(paths)}: too few "
                             f"(traces written with --trace by this version of the engine "
                             f"have phases)")
        windowed = fit_runner(fit_steps, [windows[i] for i in all_fit if not stalled[i]],
                              hinge_tokens=hinge_tokens)
        fit = windowed.fit
        overhead = fit_overhead([s.totals for s in fit_steps], [s.overhead for s in fit_steps])
        model = FittedLatencyModel(fit.coefficients, overhead=overhead,
                                   decode_hinge_tokens=hinge_tokens)
        found = [flag for t in per_trace for flag in find_stalls(model, t)]
        if not any(f and not was for f, was in zip(found, stalled)):
            break
        stalled = [f or was for f, was in zip(found, stalled)]
    run_of = [k for k, t in enumerate(per_trace) for _ in t]
    fit_runs = [run_of[i] for i in all_fit if not stalled[i]]
    windowed, few_rows = fit_with_few_rows(fit_steps, fit_runs, windowed,
                                           [windows[i] for i in all_fit if not stalled[i]],
                                           hinge_tokens=hinge_tokens)
    fit = windowed.fit
    model = FittedLatencyModel(fit.coefficients, overhead=overhead, few_rows=few_rows,
                               decode_hinge_tokens=hinge_tokens)
    local = [r for t in per_trace for r in local_ratios(model, t)]
    held = [steps[i] for i in all_held if not stalled[i]]
    held_local = [local[i] for i in all_held if not stalled[i]]
    budget = int(meta.pop("max_num_batched_tokens", 0) or 2048)
    return {"format": PROFILE_FORMAT, **meta, "source": "trace", "traces": list(paths),
            "num_steps": len(steps), "features": list(FITTED_FEATURES),
            "coefficients": fit.coefficients, "decode_hinge_tokens": hinge_tokens,
            "few_rows": {str(n): seconds for n, seconds in sorted(few_rows.items())},
            "overhead_features": list(OVERHEAD_FEATURES), "overhead": overhead,
            "fit": {"r2": fit.r2, "mean_rel_error": fit.mean_rel_error,
                    "max_rel_error": fit.max_rel_error, "num_points": len(fit_steps),
                    **_window_summary(windowed)},
            "heldout": heldout_errors(model, held, held_local),
            "machine_speed": [machine_speed(model, t) for t in per_trace],
            "variability": with_drift(model, per_trace, _per_trace(stalled, per_trace),
                                      run_holds(per_trace, holds)),
            "stalls": {"num_steps": sum(stalled),
                       "seconds": sum(s.cycle for s, f in zip(steps, stalled) if f)},
            "ttft": _ttft_curve(model, budget, int(meta.get("max_model_len") or 2048)),
            "forward_phases": fit_forward_phases(traces),
            "grid": "trace", "repeats": 1}


def _window_summary(windowed) -> dict:
    """The profile's record of the fit within windows (none when it was one window)."""
    if windowed.num_windows < 2:
        return {}
    return {"window_s": FIT_WINDOW_S, "num_windows": windowed.num_windows,
            "window_factor_min": min(windowed.factors),
            "window_factor_max": max(windowed.factors)}


def fit_few_rows(model: FittedLatencyModel, steps: Sequence[TracedStep],
                 runs: Sequence[int]) -> dict[int, float]:
    """The `few_rows` table (latency.FEW_ROWS_MAX) from steps and the run (trace) each came
    from: per token count of at most that many, the median over runs of each run's median
    residual (measured runner time, divided by the run's speed for the step's kind
    (`_run_speeds`, FEW_ROWS_RUN_SPEED), minus the linear part of `model`, its coefficients
    alone), for a count seen in FEW_ROWS_MIN_STEPS steps in all, FEW_ROWS_MIN_RUN_STEPS of them
    in each of at least FEW_ROWS_MIN_RUNS runs; an entry within FEW_ROWS_NOISE_SE standard
    errors (of its runs' medians) of the table's level pooled into it (`_pooled`); then
    detrended (`_detrended`). The kernels' staircase
    is the same in every run; a run's drift is not: in one run a count that only occurs while
    the machine runs slow would take the drift for the count's cost. (Residuals of the
    measured time over the whole run's speed, not of the time divided by fit_runner's window
    factors: in a window whose decode steps all have one row count, the factor takes that
    count's step for drift; tests/sim/test_calibrate_trace.py's staircase test fails that
    way.)"""
    linear = FittedLatencyModel(model.coefficients,
                                decode_hinge_tokens=model.decode_hinge_tokens)
    speed = _run_speeds(linear, steps, runs) if FEW_ROWS_RUN_SPEED else {}
    residuals: dict[int, dict[int, list[float]]] = {}
    for s, run in zip(steps, runs):
        if s.totals.num_tokens <= FEW_ROWS_MAX:
            factor = speed.get((run, step_kind(s.totals)), 1.0)
            residuals.setdefault(s.totals.num_tokens, {}).setdefault(run, []).append(
                s.runner / factor - linear.runner_seconds(s.totals))
    table, weight, noise = {}, {}, {}
    for n, by_run in sorted(residuals.items()):
        medians = [statistics.median(r) for r in by_run.values()
                   if len(r) >= FEW_ROWS_MIN_RUN_STEPS]
        if (len(medians) >= FEW_ROWS_MIN_RUNS
                and sum(map(len, by_run.values())) >= FEW_ROWS_MIN_STEPS):
            table[n], weight[n] = statistics.median(medians), sum(map(len, by_run.values()))
            noise[n] = 1.2533 * statistics.stdev(medians) / math.sqrt(len(medians))
    return _detrended(_pooled(table, weight, noise), weight)


def _pooled(table: dict[int, float], weight: dict[int, float],
            noise: dict[int, float]) -> dict[int, float]:
    """The table with each entry within FEW_ROWS_NOISE_SE x its standard error (`noise`) of
    the table's weighted median replaced by that median: a count's entry stands apart only
    where its runs agree it does; the rest pool into one level (which `_detrended` then
    hands to the linear model)."""
    if not table or FEW_ROWS_NOISE_SE <= 0:
        return dict(table)
    ordered = sorted(table, key=table.get)
    half, acc = sum(weight.values()) / 2, 0.0
    for n in ordered:
        acc += weight[n]
        if acc >= half:
            centre = table[n]
            break
    return {n: v if abs(v - centre) > FEW_ROWS_NOISE_SE * noise[n] else centre
            for n, v in table.items()}


def _run_speeds(linear: FittedLatencyModel, steps: Sequence[TracedStep],
                runs: Sequence[int]) -> dict[tuple[int, str], float]:
    """(run, step kind) -> the run's measured runner seconds over `linear`'s, summed over its
    steps of that kind (fit_few_rows divides it out: the drift between runs)."""
    sums: dict[tuple[int, str], list[float]] = {}
    for s, run in zip(steps, runs):
        acc = sums.setdefault((run, step_kind(s.totals)), [0.0, 0.0])
        acc[0] += s.runner
        acc[1] += linear.runner_seconds(s.totals)
    return {key: real / modelled for key, (real, modelled) in sums.items()
            if real > 0 and modelled > 0}


def _detrended(table: dict[int, float], weight: dict[int, float]) -> dict[int, float]:
    """The table less its weighted least-squares line a + b * n: the linear model's constant
    and per-row terms keep the level and the slope, the table only the staircase's shape
    (without this the two trade a common offset round after round and never settle)."""
    if len(table) < 3:
        return {n: 0.0 for n in table}
    import numpy as np

    n = np.array(list(table), dtype=float)
    y = np.array([table[k] for k in table])
    w = np.sqrt(np.array([weight[k] for k in table], dtype=float))
    a, b = np.linalg.lstsq(np.stack([w, w * n], axis=1), w * y, rcond=None)[0]
    return {k: float(v - a - b * k) for k, v in table.items()}


def fit_with_few_rows(steps: Sequence[TracedStep], runs: Sequence[int], windowed,
                      windows: Optional[Sequence] = None, rounds: int = FEW_ROWS_ROUNDS,
                      hinge_tokens: int = 0):
    """(step_fit.WindowFit, few_rows table), from `windowed` (fit_runner's fit of the linear
    model to the runner times of `steps` alone, in `windows`; `runs`: each step's run, see
    fit_few_rows): the table fitted to the residuals of the linear model, then the linear
    model (fit_runner, in the same windows) to the runner times less the table, alternately,
    `rounds` tables in all (`hinge_tokens`: the knee `windowed` was fitted with)."""
    windows = list(windows or [0] * len(steps))

    def linear(w) -> FittedLatencyModel:
        return FittedLatencyModel(w.fit.coefficients, decode_hinge_tokens=hinge_tokens)

    table = fit_few_rows(linear(windowed), steps, runs)
    for _ in range(rounds - 1):
        targets = [max(s.runner - table.get(s.totals.num_tokens, 0.0), 0.1 * s.runner)
                   for s in steps]
        windowed = fit_runner(steps, windows, targets, hinge_tokens)
        table = fit_few_rows(linear(windowed), steps, runs)
    return windowed, table


def _per_trace(flags: Sequence[bool], per_trace: Sequence[Sequence]) -> list[list[bool]]:
    """Flags over all traces' steps, split back per trace."""
    out, at = [], 0
    for steps in per_trace:
        out.append(list(flags[at:at + len(steps)]))
        at += len(steps)
    return out


def _common_meta(traces: list[Trace], paths: Sequence[str]) -> dict:
    """The run settings of the first trace; ValueError when another disagrees on one that
    changes step times (model, dtype, device, threads)."""
    first = traces[0].meta
    for trace, path in zip(traces[1:], paths[1:]):
        for key in ("model", "dtype", "device", "threads"):
            if trace.meta.get(key) != first.get(key):
                raise ValueError(f"{path}: {key}={trace.meta.get(key)!r} but {paths[0]} has "
                                 f"{first.get(key)!r}; fit traces of one setting at a time")
    meta = {k: first.get(k) for k in META_KEYS}
    meta["max_num_batched_tokens"] = first.get("max_num_batched_tokens")
    return meta


def _ttft_curve(model: FittedLatencyModel, budget: int, longest: int) -> dict:
    """The TTFT predictor a * n + b * n^2 + c fitted to the model's own solo TTFTs (relative
    error: short prompts count as much as long ones). Quadratic, as attention makes the curve
    convex: a line through it had a negative intercept (-50 to -140 ms on SmolLM2)."""
    from tokenweir.sim.slo_cuts import fit_ttft

    predictor, r2 = fit_ttft(model, budget, longest, quadratic=True)
    return {"a": predictor.a, "b": predictor.b, "c": predictor.c, "r2": r2}


def format_heldout(profile: dict) -> str:
    h, o = profile.get("heldout", {}), profile.get("overhead", {})
    lines = [format_hinge(profile)] if profile.get("hinge_choice") else []
    lines += ["engine overhead per step = " + " + ".join(
        f"{1000 * o.get(f, 0.0):.4g} ms*{f}" for f in OVERHEAD_FEATURES)]
    if h.get("num_steps"):
        lines.append(
            f"held-out steps ({h['num_steps']}): step time error mean "
            f"{100 * h['mean_rel_error']:.1f}%, p90 {100 * h['p90_rel_error']:.1f}%; summed "
            f"time {100 * h['total_rel_error']:+.2f}%; runner alone mean "
            f"{100 * h['runner_mean_rel_error']:.1f}%; overhead measured "
            f"{h['overhead_mean_ms']:.3f} ms/step, fitted {h['overhead_mean_ms_fit']:.3f}")
    if "local_mean_rel_error" in h:
        lines.append(f"runner against its neighbours (the machine's drift divided out, "
                     f"`local_ratios`): held-out mean {100 * h['local_mean_rel_error']:.1f}%")
    stalls = profile.get("stalls") or {}
    if stalls.get("num_steps"):
        lines.append(f"stalls left out of the fit: {stalls['num_steps']} steps, "
                     f"{stalls['seconds']:.2f} s (runner > {STALL_LOCAL_RATIO:g}x its "
                     f"neighbours, or overhead > {1000 * STALL_OVERHEAD_S:g} ms)")
    v = profile.get("variability")
    if v:
        lines.append(f"machine variability (log-space sigma, `variability`): step to step "
                     f"{100 * v['step_sigma']:.1f}% over {v['num_steps']} steps, run to run "
                     f"{100 * v['run_sigma']:.1f}% over {v['num_run_kinds']} (run, kind) pairs"
                     + (f"; drift inside runs {100 * v['drift_sigma']:.1f}%, correlation "
                        f"time {v['drift_tau_s']:.1f} s over {v['num_windows']} windows "
                        f"(`drift.fit_drift`)" if "drift_sigma" in v else ""))
        if v.get("kinds"):
            lines.append(format_kind_law(v))
    names = [Path(t).name for t in profile.get("traces", [])]
    lines += [format_speed(f"machine speed in {name}", speed)
              for name, speed in zip(names, profile.get("machine_speed", []))]
    return "\n".join(lines)


def format_kind_law(v: dict) -> str:
    """One line: the variability per step kind (`drift.fit_kind_law`)."""
    parts = [f"{kind} run {100 * k['run_sigma']:.1f}%"
             + (f" (hold {100 * k['hold_sigma']:.1f}%)" if "hold_sigma" in k else "")
             + f" step {100 * k['step_sigma']:.1f}% drift {100 * k['drift_sigma']:.1f}%"
             for kind, k in v["kinds"].items()]
    holds = f" ({v['num_holds']} holds)" if "num_holds" in v else ""
    return (f"per step kind (`drift.fit_kind_law`{holds}): {'; '.join(parts)}; the kinds' run logs "
            f"correlate {v.get('kind_run_rho', 0.0):.2f}, their drifts "
            f"{v.get('kind_drift_rho', 0.0):.2f}")


def format_hinge(profile: dict) -> str:
    """One line: the decode-context hinge chosen (`choose_hinge`) and each knee's error."""
    knee = profile.get("decode_hinge_tokens") or 0
    choice = ", ".join(f"{k}: {100 * e:.2f}%" for k, e in profile["hinge_choice"].items())
    return ((f"decode-context hinge: {1e6 * profile['coefficients']['decode_context_hinge']:.3g}"
             f" us per decode context token past {knee}" if knee else
             "decode-context hinge: none") + f" (held-out runner error by knee: {choice})")


def format_speed(label: str, speed: dict) -> str:
    """One line: per kind, the run's measured/modelled runner time and its window range."""
    parts = [f"{kind} {v['ratio']:.2f}x [{v['min']:.2f}-{v['max']:.2f}]"
             for kind, v in speed.items()]
    return (f"{label}: " + ", ".join(parts or ["no steps"])
            + f" ([range] over {SPEED_WINDOW_S:g}-s windows)")


# The decode-context hinge (latency.fitted_features; issue 36, fid7): its knee is chosen from
# HINGE_KNEES by the held-out runner error (the steps every fit leaves out), and only a knee
# that lowers it by HINGE_MIN_GAIN of itself or more is kept (else 0, no hinge: a fit without
# the convexity must not get a hinge from floating-point ties). On fid5's suite (ten
# calibration runs of one hold) the knees 500-2000 each lowered the held-out runner error
# 9.47% -> 9.39-9.41% and moved the validation runs' decode steps of >= 3 rows at >= 300
# context tokens each from 1.107x the profile to 1.064-1.095x (the rest 1.022-1.025x either
# way); the hinge took the whole decode-attention slope (linear term 2.74 -> 0 us/token,
# hinge 5.0-7.8 us/token past the knee). The gain must also reach HINGE_MIN_GAIN_ABS (0.01
# points of relative error): fits that all reproduce their steps (errors ~1e-12) differ only
# by rounding.
HINGE_KNEES = (0, 500, 750, 1000, 1500, 2000)
HINGE_MIN_GAIN = 0.002
HINGE_MIN_GAIN_ABS = 1e-4


def choose_hinge(fit) -> dict:
    """The profile `fit(knee)` (a profile dict per knee) with the lowest held-out runner error
    over HINGE_KNEES, a knee kept only if it beats no hinge (knee 0) by HINGE_MIN_GAIN of
    that error and by HINGE_MIN_GAIN_ABS; the profile records every knee's error
    ("hinge_choice": {knee: error})."""
    profiles = {knee: fit(knee) for knee in HINGE_KNEES}
    errors = {knee: p["heldout"].get("runner_mean_rel_error", math.inf)
              for knee, p in profiles.items()}
    best = min(HINGE_KNEES, key=lambda knee: (errors[knee], knee))
    if not errors[0] - errors[best] >= max(HINGE_MIN_GAIN * errors[0], HINGE_MIN_GAIN_ABS):
        best = 0
    return {**profiles[best], "hinge_choice": {str(k): e for k, e in errors.items()}}
