"""Fitting the simulator's step-time model to measured steps: non-negative least squares over
the fitted features (sim/latency.py), and the TTFT line. Used by calibration from a timed grid
(calibrate.py) and from the engine's step traces (calibrate_trace.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

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
                   weight_power: float = 1.0, reweight_rounds: int = 0) -> Fit:
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
    (decode steps 96.2%); the reweighted one 100.0%. Grid medians (`calibrate`) need none."""
    import numpy as np

    if len(totals) != len(seconds) or not totals:
        raise ValueError("need one time per step shape, and at least one")
    if any(s <= 0 for s in seconds):
        raise ValueError("step times must be positive")
    x = np.array([fitted_features(t) for t in totals], dtype=float)
    y = np.array(seconds, dtype=float)
    coef = _nonnegative_fit(x, y, y ** weight_power)
    for _ in range(reweight_rounds):
        predicted = x @ coef
        scale = np.where(predicted > 0, predicted, y) ** weight_power
        coef = _nonnegative_fit(x, y, scale)
    predicted = x @ coef
    return Fit({f: float(c) for f, c in zip(FITTED_FEATURES, coef)}, _r2(y, predicted),
               *_relative_errors(y, predicted), [float(p) for p in predicted])


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
