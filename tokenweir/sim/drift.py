"""The machine's speed drifting inside a run: measured from engine traces, drawn in simulations.

A real run is not one speed plus step jitter. On issue 36's 2-vCPU machine a run's 3-s windows
ran 0.78-1.55x the profile while the run as a whole sat within a few percent of it. Neither of
the profile's two sigmas holds that: "run_sigma" is each run's mean speed, "step_sigma" each
step against its neighbours (the slow part divided out). Drift is the part in between, and
unlike step jitter it does not average out over a percentile's worth of requests: a slow
stretch slows every request in flight together.

The model (`DriftProcess`): the log of the machine's speed factor is an Ornstein-Uhlenbeck
process over the engine's busy clock (the sum of its step times), stationary log-space sigma
`drift_sigma`, correlation time `drift_tau_s`: two windows t seconds apart are correlated
exp(-t / tau). The busy clock, not the wall clock, because the simulator's latency model sees
steps, not idle gaps; the fit (`fit_drift`) counts time the same way (each step's cycle, gaps
capped as calibrate_trace caps them).

The fit: each run cut into windows of DRIFT_WINDOW_S busy seconds; per window and step kind
with MIN_WINDOW_STEPS steps of it, the log of measured over modelled runner time less the
run's own log ratio for that kind (the run's mean is run_sigma's). drift_sigma^2 is the mean
square of those logs less the step jitter's share (step_sigma^2 over the window's effective
step count), at least 0; adjacent windows' mean product over drift_sigma^2 is their
correlation rho, and tau = -DRIFT_WINDOW_S / ln(rho) (rho clipped to [RHO_MIN, RHO_MAX]).
It is an upper bound of the machine alone: the model's error between windows of different
step composition counts as drift too, as the model's error between neighbouring steps counts
in step_sigma."""

from __future__ import annotations

import math
import random
from typing import Sequence

DRIFT_WINDOW_S = 3.0  # busy seconds per window of the fit
MIN_WINDOW_STEPS = 5  # steps of a kind a window needs to give that kind a ratio
RHO_MIN, RHO_MAX = 0.05, 0.95  # tau between ~1/3 and ~58 windows


class DriftProcess:
    """A seeded log-space Ornstein-Uhlenbeck speed factor over a busy clock: `factor()` is
    the current factor (mean 1 over the stationary law), `advance(seconds)` moves the clock.
    It starts at a stationary draw, so a run may begin in a slow stretch."""

    def __init__(self, sigma: float, tau_s: float, seed: int = 0) -> None:
        if sigma < 0 or tau_s <= 0:
            raise ValueError(f"need sigma >= 0 and tau_s > 0, got {sigma}, {tau_s}")
        self.sigma, self.tau_s = sigma, tau_s
        self._rng = random.Random(seed)
        self._x = self._rng.gauss(0.0, sigma)

    def factor(self) -> float:
        return math.exp(self._x - self.sigma * self.sigma / 2)

    def advance(self, seconds: float) -> None:
        decay = math.exp(-max(0.0, seconds) / self.tau_s)
        self._x = (self._x * decay
                   + self.sigma * math.sqrt(1.0 - decay * decay) * self._rng.gauss(0.0, 1.0))


def window_logs(model, steps: Sequence, kind_of, window_s: float = DRIFT_WINDOW_S
                ) -> list[list[tuple[int, float, float]]]:
    """Per step kind of one run: (window index, log ratio less the run's, effective steps)
    for every window of `window_s` busy seconds with MIN_WINDOW_STEPS steps of that kind.
    `steps` have .totals, .runner and .cycle; `kind_of(totals)` names a step's kind."""
    sums: dict[str, dict[int, list[float]]] = {}
    clock = 0.0
    for s in steps:
        predicted = model.runner_seconds(s.totals)
        acc = sums.setdefault(kind_of(s.totals), {}).setdefault(int(clock // window_s),
                                                              [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += s.runner
        acc[2] += predicted
        acc[3] += predicted * predicted
        clock += s.cycle
    out = []
    for windows in sums.values():
        real, modelled = (sum(a[i] for a in windows.values()) for i in (1, 2))
        if modelled <= 0 or real <= 0:
            continue
        mean = math.log(real / modelled)
        out.append([(w, math.log(a[1] / a[2]) - mean, a[2] * a[2] / a[3])
                    for w, a in sorted(windows.items())
                    if a[0] >= MIN_WINDOW_STEPS and a[1] > 0 and a[2] > 0])
    return out


def fit_drift(model, per_trace: Sequence[Sequence], kind_of, step_sigma: float,
              window_s: float = DRIFT_WINDOW_S) -> dict:
    """{"drift_sigma", "drift_tau_s", "num_windows"} from runs' traced steps (stalls left
    out by the caller); see the module doc. Fewer than 4 windows: drift_sigma 0."""
    logs, pairs, num_series = [], [], 0
    for steps in per_trace:
        for series in window_logs(model, steps, kind_of, window_s):
            logs += [(x, n) for _, x, n in series]
            pairs += [a[1] * b[1] for a, b in zip(series, series[1:]) if b[0] == a[0] + 1]
            num_series += 1
    n = len(logs)
    if n - num_series < 4:
        return {"drift_sigma": 0.0, "drift_tau_s": window_s, "num_windows": n}
    observed = sum(x * x for x, _ in logs) / (n - num_series)  # each run's mean taken out
    jitter = step_sigma * step_sigma * sum(1.0 / k for _, k in logs) / n
    variance = max(0.0, observed - jitter)
    rho = sum(pairs) / len(pairs) / variance if pairs and variance > 0 else RHO_MIN
    rho = min(RHO_MAX, max(RHO_MIN, rho))
    return {"drift_sigma": math.sqrt(variance), "drift_tau_s": -window_s / math.log(rho),
            "num_windows": n}
