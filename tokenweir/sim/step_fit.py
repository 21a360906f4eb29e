"""Fitting the simulator's step-time model to measured steps: non-negative least squares over
the fitted features (sim/latency.py), and the TTFT line. Used by calibration from a timed grid
(calibrate.py) and from the engine's step traces (calibrate_trace.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from tokenweir.sim.latency import FITTED_FEATURES, StepTotals, fitted_features

PROFILE_FORMAT = "tokenweir-step-profile/1"


@dataclass(frozen=True)
class Fit:
    coefficients: dict[str, float]
    r2: float
    mean_rel_error: float
    max_rel_error: float
    predicted: list[float]


def fit_step_model(totals: Sequence[StepTotals], seconds: Sequence[float],
                   weight_power: float = 1.0, reweight_rounds: int = 0,
                   hinge_tokens: int = 0) -> Fit:
    """Non-negative least squares over `fitted_features`, each step's residual divided by
    its time ** weight_power: 1 fits relative error (every step counts alike), 0 absolute
    error (long steps dominate), 0.5 in between.

    "Its time" is the measured one, unless reweight_rounds > 0: then the fit is redone that
    many times with each residual divided by the previous fit's PREDICTED time ** power
    instead (iteratively reweighted least squares). Use it on noisy single runs: a measured
    time in the divisor gives a step that ran slow for a reason of its own (a stall, a busy
    neighbour) a smaller weight BECAUSE it ran slow, which pulls the fit below the mean (with
    power 1 it fits the harmonic mean of repeats of one shape). On the fidelity suite's real
    traces (issue 16) the measured-time fit predicted 97.3% of its own steps' summed time
    (decode steps 96.2%); the reweighted one 100.0%. Grid medians (`calibrate`) need none.
    `hinge_tokens`: the knee of the decode-context hinge (`fitted_features`; 0: none)."""
    import numpy as np

    if len(totals) != len(seconds) or not totals:
        raise ValueError("need one time per step shape, and at least one")
    if any(s <= 0 for s in seconds):
        raise ValueError("step times must be positive")
    x = np.array([fitted_features(t, hinge_tokens) for t in totals], dtype=float)
    y = np.array(seconds, dtype=float)
    coef = _nonnegative_fit(x, y, y ** weight_power)
    for _ in range(reweight_rounds):
        predicted = x @ coef
        scale = np.where(predicted > 0, predicted, y) ** weight_power
        coef = _nonnegative_fit(x, y, scale)
    predicted = x @ coef
    return Fit({f: float(c) for f, c in zip(FITTED_FEATURES, coef)}, _r2(y, predicted),
               *_relative_errors(y, predicted), [float(p) for p in predicted])


# ---- the fit within windows (issue 36, fid6) -----------------------------------------------
# On a shared machine a run's speed drifts over seconds (calibrate_trace.speed_windows: 3-s
# windows at 0.8-1.4x), and what a run does drifts with it: its decode contexts grow as its
# requests age, its batches fill and drain. A plain fit takes part of the drift for the terms
# that move with it. On fid5's suite (ten calibration runs of five workloads) it fitted decode
# attention at 0.56 us per context token (-0.38 us on decode steps alone), while the
# validation runs' decode steps of the prefix workload (3,000-token contexts) ran 1.06-1.30x
# that profile; within 3-s windows (calibrate_trace.fit_runner) 2.74 us, and 1.5-7.6 us for
# windows of 0.5-6 s: weakly identified, but nowhere near 0.56. `fit_within_windows` fits the
# shape from the differences inside each window: one free speed factor per window.
MIN_WINDOW_FIT_STEPS = 5  # a window with fewer steps gets no factor of its own (1)
_LEVEL_WEIGHT = 1e3  # the level constraint's row, relative to the largest step row


@dataclass(frozen=True)
class WindowFit:
    fit: Fit  # coefficients of the machine at its mean speed; `predicted` without factors
    factors: list[float]  # per step, its window's speed factor (1 in a window too small)
    rounds: int  # least-squares solves (1 + reweighting rounds)
    num_windows: int = 0  # windows with a factor of their own (MIN_WINDOW_FIT_STEPS steps)


def fit_within_windows(totals: Sequence[StepTotals], seconds: Sequence[float],
                       windows: Sequence, weight_power: float = 1.0,
                       reweight_rounds: int = 0, levels: Optional[Sequence] = None,
                       hinge_tokens: int = 0) -> WindowFit:
    """`fit_step_model` with a free speed factor per window (`windows`: a hashable key per
    step, e.g. (run, window index, step kind)): the coefficients c >= 0 and the windows'
    inverse factors g minimise sum (g_w y_i - x_i . c)^2 / p_i^(2 weight_power) (p_i the
    predicted time after reweighting, y_i the measured one at first), exactly: for given c
    each g_w is a 1-D least-squares solution, so eliminating it leaves one linear least-squares
    problem in c (variable projection; alternating c and g converges slowly along weakly
    identified directions and stalls short of the optimum). The level, which factors and
    coefficients trade freely, is fixed per level group (`levels`: a key per step, e.g. its
    step kind; None: one group; each window inside one group): sum x_i . c = sum y_i over the
    group's steps, so each group keeps its steps' summed time (the runs' mean speed) and only
    the differences inside windows set the shape. Windows of fewer than MIN_WINDOW_FIT_STEPS
    steps keep g = 1. Returns each step's factor (its window's measured over modelled
    seconds; 1 in a small window) scaled to a time-weighted mean of 1 per group. Every window
    small, or a single window: exactly `fit_step_model`."""
    import numpy as np

    if len(windows) != len(seconds) or (levels is not None and len(levels) != len(seconds)):
        raise ValueError("need one window key (and level key) per step")
    keys = {k: i for i, k in enumerate(dict.fromkeys(windows))}
    where = np.array([keys[k] for k in windows])
    y = np.asarray(seconds, dtype=float)
    big = np.bincount(where, minlength=len(keys)) >= MIN_WINDOW_FIT_STEPS
    if len(keys) == 1 or not big.any():
        return WindowFit(fit_step_model(totals, seconds, weight_power, reweight_rounds,
                                        hinge_tokens),
                         [1.0] * len(y), 1, int(big.sum()))
    group_keys = {k: i for i, k in enumerate(dict.fromkeys(levels or [0] * len(y)))}
    group = np.array([group_keys[k] for k in (levels or [0] * len(y))])
    x = np.array([fitted_features(t, hinge_tokens) for t in totals], dtype=float)
    scale = y ** weight_power
    for _ in range(1 + reweight_rounds):
        coef = _within_windows_solve(x, y, where, big[where], group, scale)
        predicted = x @ coef
        scale = np.where(predicted > 0, predicted, y) ** weight_power
    per_step = _step_factors(y, predicted, where, big, group)
    normalised = y / per_step
    fit = Fit({f: float(c) for f, c in zip(FITTED_FEATURES, coef)}, _r2(normalised, predicted),
              *_relative_errors(normalised, predicted), [float(p) for p in predicted])
    return WindowFit(fit, [float(f) for f in per_step], 1 + reweight_rounds, int(big.sum()))


def _step_factors(y, predicted, where, big, group):
    """Per step, its window's measured over modelled seconds (1 in a window too small),
    scaled to a time-weighted mean of 1 over each level group."""
    import numpy as np

    n = len(big)
    factor = np.where(big, np.bincount(where, y, n)
                      / np.maximum(np.bincount(where, predicted, n), 1e-300), 1.0)
    per_step = factor[where]
    for g in range(group.max() + 1):
        mine = group == g
        per_step[mine] /= float(np.sum(per_step[mine] * predicted[mine])
                                / max(np.sum(predicted[mine]), 1e-300))
    return per_step


def _within_windows_solve(x, y, where, in_big, group, scale):
    """The coefficients (>= 0) of `fit_within_windows` for fixed residual scales: rows of
    steps in a big window are x_i - y_i m_w (m_w = sum_w y x / scale^2 over sum_w y^2 /
    scale^2, g_w eliminated) with target 0; rows of other steps x_i with target y_i; all
    divided by scale; plus one level row per group (sum x = sum y over it), weighted
    _LEVEL_WEIGHT times the largest step row."""
    import numpy as np

    w2 = 1.0 / scale ** 2
    num = np.zeros((where.max() + 1, x.shape[1]))
    np.add.at(num, where, (w2 * y)[:, None] * x)
    den = np.bincount(where, w2 * y * y, where.max() + 1)
    m = num / np.maximum(den, 1e-300)[:, None]
    rows = np.where(in_big[:, None], x - y[:, None] * m[where], x) / scale[:, None]
    target = np.where(in_big, 0.0, y) / scale
    top = np.abs(rows).max()
    for g in range(group.max() + 1):
        sums = x[group == g].sum(axis=0)
        level = _LEVEL_WEIGHT * top / max(np.abs(sums).max(), 1e-300)
        rows = np.vstack([rows, level * sums])
        target = np.append(target, level * y[group == g].sum())
    return _nonnegative_fit(rows, target, np.ones(len(target)))


def _nonnegative_fit(x, y, scale):
    """Coefficients >= 0 minimising sum ((y - x @ c) / scale) ** 2: features no row uses
    stay 0; while a coefficient comes out negative, the most negative feature leaves and the
    rest are refitted."""
    import numpy as np

    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] / scale[:, None], y / scale, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Ordinary least squares y = a x + c; returns (a, c, r2)."""
    import numpy as np

    if len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    a, c = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    predicted = [a * x + c for x in xs]
    return float(a), float(c), _r2(np.asarray(ys, dtype=float), np.asarray(predicted))


def _r2(y, predicted) -> float:
    import numpy as np

    total = float(np.sum((y - np.mean(y)) ** 2))
    residual = float(np.sum((y - predicted) ** 2))
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else -math.inf)


def _relative_errors(y, predicted) -> tuple[float, float]:
    rel = [abs(p - t) / t for p, t in zip(predicted, y)]
    return float(sum(rel) / len(rel)), float(max(rel))
