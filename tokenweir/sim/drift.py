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
in step_sigma.

Per step kind (issue 36, fid15): decode steps (memory-bound) and steps with a prefill chunk
(compute-bound) do not scatter alike. On fid14's ten calibration runs the prefill steps'
run-to-run log-sd was 9.9% (decode 6.6%), step to step 7.3% (4.1%), drift inside runs ~17%
(~9%), the two kinds' run logs correlating 0.71 and their same-window drift 0.73; one
kind-blind law (8.4%, 4.4%, 11.8%) draws prefill steps too tame and decode steps too wild.
`KindLaw` holds each kind's three sigmas and the two correlations (`fit_kind_law` fits them:
calibrate_trace.with_drift), `KindNoisyModel` draws a run on it.

The hold (issue 36, fid16): runs collected together share the machine's speed. On fid14's suite
(one 19-min invocation, then three of ~5 min) the run logs of runs under 100 s apart correlate
+0.2..+0.5 (prefill), those 10 min apart not at all; its three validation swap runs, 1.5 min
apart, all measured 0.87-0.93x the profile's time (fitted to runs 5-10 min earlier). A run's log speed per kind is a hold part, shared
by the runs of one hold (`infer_holds`), plus its own: run_sigma^2 = hold_sigma^2 +
within^2. `fit_hold_split` splits the fitted run sigma from the runs' hold labels (one-way
random effects: within^2 the pooled variance around each hold's mean; a single hold leaves the
split unidentified: hold_sigma 0). A run drawn alone keeps the run sigma it had; runs drawn in
one hold (`KindNoisyModel(hold_units=...)`, one `draw_units` per hold) correlate
hold_sigma^2 / run_sigma^2, so their mean scatters more."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

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

    def standard(self) -> float:
        """The log factor's current deviation in units of sigma (a unit normal over the
        stationary law; 0 when sigma is 0)."""
        return self._x / self.sigma if self.sigma > 0 else 0.0

    def advance(self, seconds: float) -> None:
        decay = math.exp(-max(0.0, seconds) / self.tau_s)
        self._x = (self._x * decay
                   + self.sigma * math.sqrt(1.0 - decay * decay) * self._rng.gauss(0.0, 1.0))


def window_logs(model, steps: Sequence, kind_of, window_s: float = DRIFT_WINDOW_S
                ) -> list[list[tuple[int, float, float]]]:
    """Per step kind of one run: (window index, log ratio less the run's, effective steps)
    for every window of `window_s` busy seconds with MIN_WINDOW_STEPS steps of that kind.
    `steps` have .totals, .runner and .cycle; `kind_of(totals)` names a step's kind."""
    return list(kind_window_logs(model, steps, kind_of, window_s).values())


def kind_window_logs(model, steps: Sequence, kind_of, window_s: float = DRIFT_WINDOW_S
                     ) -> dict[str, list[tuple[int, float, float]]]:
    """`window_logs` keyed by kind (kinds in the order their first step came)."""
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
    out = {}
    for kind, windows in sums.items():
        real, modelled = (sum(a[i] for a in windows.values()) for i in (1, 2))
        if modelled <= 0 or real <= 0:
            continue
        mean = math.log(real / modelled)
        out[kind] = [(w, math.log(a[1] / a[2]) - mean, a[2] * a[2] / a[3])
                     for w, a in sorted(windows.items())
                     if a[0] >= MIN_WINDOW_STEPS and a[1] > 0 and a[2] > 0]
    return out


def fit_drift(model, per_trace: Sequence[Sequence], kind_of, step_sigma: float,
              window_s: float = DRIFT_WINDOW_S, only: Optional[str] = None) -> dict:
    """{"drift_sigma", "drift_tau_s", "num_windows"} from runs' traced steps (stalls left
    out by the caller); see the module doc. Fewer than 4 windows: drift_sigma 0. `only`: the
    windows of that kind alone (the clock still counts every step)."""
    logs, pairs, num_series = [], [], 0
    for steps in per_trace:
        by_kind = kind_window_logs(model, steps, kind_of, window_s)
        for kind, series in by_kind.items():
            if only is not None and kind != only:
                continue
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


# ---- per step kind (fid15) -------------------------------------------------------------------
KINDS = ("decode", "prefill")  # latency.STEP_KINDS, named here so this module imports nothing


@dataclass(frozen=True)
class KindLaw:
    """The machine's noise per step kind, log-space sigmas: "run" (a run's mean speed),
    "step" (step to step, the drift divided out), "drift" (an Ornstein-Uhlenbeck wander
    inside a run, correlation time `drift_tau_s`, shared by the kinds); `run_rho` and
    `drift_rho`: the correlation of the two kinds' run logs and of their drifts."""
    run: Mapping[str, float]
    step: Mapping[str, float]
    drift: Mapping[str, float]
    run_rho: float
    drift_rho: float
    drift_tau_s: float
    hold: Mapping[str, float] = field(default_factory=dict)  # the run sigma's part a hold shares

    def hold_sigma(self, kind: str) -> float:
        """The kind's hold part of the run sigma, within [0, run sigma]."""
        return min(self.run[kind], max(0.0, float(self.hold.get(kind, 0.0))))

    def draw_units(self, rng: random.Random) -> dict[str, float]:
        """Two unit normals, decode's and prefill's, correlated run_rho: a run's (or a
        hold's) standard run-speed draw, two gauss calls on `rng`."""
        rho = max(-1.0, min(1.0, self.run_rho))
        z1, z2 = rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)
        return {"decode": z1, "prefill": rho * z1 + math.sqrt(1.0 - rho * rho) * z2}

    @staticmethod
    def from_variability(v: Optional[Mapping]) -> Optional["KindLaw"]:
        """The law a profile's "variability" records under "kinds" (`fit_kind_law`), or None
        when it records none (a profile fitted before fid15: draw it kind-blind). Without a
        kind-blind "drift_sigma" (the floor's --no-floor-drift strips it) no kind drifts."""
        kinds = (v or {}).get("kinds")
        if not kinds:
            return None
        drift = bool(v.get("drift_sigma"))
        sigma = {k: {key: float(kinds.get(k, {}).get(f"{key}_sigma", 0.0))
                     for key in ("run", "step", "drift")} for k in KINDS}
        return KindLaw({k: sigma[k]["run"] for k in KINDS},
                       {k: sigma[k]["step"] for k in KINDS},
                       {k: sigma[k]["drift"] if drift else 0.0 for k in KINDS},
                       float(v.get("kind_run_rho", 0.0)), float(v.get("kind_drift_rho", 0.0)),
                       float(v.get("drift_tau_s") or 1.0),
                       {k: float(kinds.get(k, {}).get("hold_sigma", 0.0)) for k in KINDS})


def kind_run_logs(model, steps: Sequence, kind_of) -> dict[str, float]:
    """One run's {kind: log measured/modelled runner time}, the kinds with MIN_WINDOW_STEPS
    steps in it."""
    logs = {}
    for kind in KINDS:
        mine = [s for s in steps if kind_of(s.totals) == kind]
        modelled = sum(model.runner_seconds(s.totals) for s in mine)
        if len(mine) >= MIN_WINDOW_STEPS and modelled > 0:
            logs[kind] = math.log(sum(s.runner for s in mine) / modelled)
    return logs


def _rho(products: Sequence[float], sd_a: float, sd_b: float) -> float:
    """A correlation from mean products of zero-mean logs over the two sigmas, in [-1, 1];
    0 without products or with a sigma of 0."""
    if not products or sd_a <= 0 or sd_b <= 0:
        return 0.0
    return max(-1.0, min(1.0, sum(products) / len(products) / (sd_a * sd_b)))


def fit_kind_law(model, per_trace: Sequence[Sequence], kind_of,
                 step_logs: Mapping[str, Sequence[float]], window_s: float = DRIFT_WINDOW_S,
                 holds: Optional[Sequence[int]] = None) -> dict:
    """{"kinds": {kind: {"run_sigma", "step_sigma", "drift_sigma", "num_runs", "num_steps",
    "num_windows"}}, "kind_run_rho", "kind_drift_rho"} (a profile's variability keys; the
    law `KindLaw.from_variability` reads). `step_logs`: per kind, the logs of its steps'
    local ratios (calibrate_trace.local_ratios). Per kind, as the kind-blind fit does over
    all steps: step_sigma 1.4826 x the median |log|; run_sigma the root mean square of each
    run's log measured/modelled runner time for the kind (runs with MIN_WINDOW_STEPS steps
    of it; 0 with fewer than 3 runs); the drift `fit_drift(only=kind)` with the kind's step
    sigma. The run correlation: mean product of the two kinds' run logs over the runs with
    both, over the run sigmas; the drift's: the same over windows holding both kinds, over
    the drift sigmas (step jitter is independent between steps, so it leaves the product
    alone). With `holds` (per trace, its hold: `infer_holds`) each kind also gets
    "hold_sigma", the run sigma's part its hold shares (`fit_hold_split`)."""
    kinds: dict[str, dict] = {}
    run_logs = [kind_run_logs(model, steps, kind_of) for steps in per_trace]
    for kind in KINDS:
        logs = sorted(abs(x) for x in step_logs.get(kind, ()))
        step = 1.4826 * _median(logs) if logs else 0.0
        runs = [r[kind] for r in run_logs if kind in r]
        run = math.sqrt(sum(x * x for x in runs) / len(runs)) if len(runs) >= 3 else 0.0
        d = fit_drift(model, per_trace, kind_of, step, window_s, only=kind)
        kinds[kind] = {"run_sigma": run, "step_sigma": step, "drift_sigma": d["drift_sigma"],
                       "num_runs": len(runs), "num_steps": len(logs),
                       "num_windows": d["num_windows"]}
    if holds is not None:
        for kind, hold in fit_hold_split(run_logs, holds).items():
            kinds[kind]["hold_sigma"] = hold
    both = [r["decode"] * r["prefill"] for r in run_logs if len(r) == 2]
    same_window = []
    for steps in per_trace:
        by_kind = kind_window_logs(model, steps, kind_of, window_s)
        prefill = {w: x for w, x, _ in by_kind.get("prefill", [])}
        same_window += [x * prefill[w] for w, x, _ in by_kind.get("decode", []) if w in prefill]
    return {"kinds": kinds,
            "kind_run_rho": _rho(both, kinds["decode"]["run_sigma"],
                                 kinds["prefill"]["run_sigma"]) if len(both) >= 3 else 0.0,
            "kind_drift_rho": _rho(same_window, kinds["decode"]["drift_sigma"],
                                   kinds["prefill"]["drift_sigma"])}


# ---- the hold (fid16) -----------------------------------------------------------------------
# A longer gap between one run's last step and the next run's first (on one trace clock) starts
# another hold: a new invocation loads the model and warms up (fid14's holds: 55-57 s), while
# runs of one invocation follow each other within 1.5-4.7 s (a retried run: one run's length).
HOLD_GAP_S = 20.0
# A hold's runs start within this of its first run. Measured, fid14's suite: run logs under 100
# s apart correlate +0.2..+0.5 on prefill, 10 min apart not at all, inside one 19-min
# invocation (its first six runs' logs, measured over modelled, average +0.017 decode and
# +0.051 prefill, its next nineteen -0.059 and -0.071): a long invocation is several holds.
HOLD_SPAN_S = 300.0


@dataclass(frozen=True)
class RunStamp:
    """When a run ran: its first step's start and its last step's end on its trace clock
    (seconds), and the hold its collector recorded (None: inferred from the clock)."""
    start: float
    end: float
    hold: Optional[str] = None


def infer_holds(stamps: Sequence[RunStamp], gap_s: float = HOLD_GAP_S,
                span_s: float = HOLD_SPAN_S) -> list[int]:
    """Per run (in the order given), its hold: 0, 1, ... in order of time. Runs taken by
    start; a run begins a new hold when its recorded hold differs from the previous run's,
    when it starts more than `gap_s` after the previous run's end (or before it: another
    clock), or more than `span_s` after its hold's first run started."""
    order = sorted(range(len(stamps)), key=lambda i: stamps[i].start)
    out = [0] * len(stamps)
    hold, first, prev = -1, None, None
    for i in order:
        s = stamps[i]
        if (prev is None or s.hold != prev.hold or not 0 <= s.start - prev.end <= gap_s
                or s.start - first.start > span_s):
            hold, first = hold + 1, s
        out[i], prev = hold, s
    return out


def fit_hold_split(run_logs: Sequence[Mapping[str, float]], holds: Sequence[int]
                   ) -> dict[str, float]:
    """Per kind, the hold part of the run sigma from runs' log speeds (`run_logs`, per run
    {kind: log measured/modelled}, the kind absent where the run has too few of its steps) and
    their holds: run^2 the mean square of the logs (as fit_kind_law's run sigma), within^2
    the pooled variance around each hold's mean (N - H degrees of freedom), hold =
    sqrt(max(0, run^2 - within^2)). 0 with fewer than 2 holds or N - H < 2: one hold cannot
    tell a shared speed from a run's own."""
    out = {}
    for kind in KINDS:
        groups: dict[int, list[float]] = {}
        for logs, h in zip(run_logs, holds):
            if kind in logs:
                groups.setdefault(h, []).append(logs[kind])
        n = sum(len(g) for g in groups.values())
        if len(groups) < 2 or n - len(groups) < 2:
            out[kind] = 0.0
            continue
        total = sum(x * x for g in groups.values() for x in g) / n
        within = sum((x - sum(g) / len(g)) ** 2 for g in groups.values() for x in g)
        out[kind] = math.sqrt(max(0.0, total - within / (n - len(groups))))
    return out


def _median(xs: Sequence[float]) -> float:
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2


# The drift's mean correction (fid16). The drift is stationary over the busy clock, and a slow
# stretch holds fewer steps per busy second than a fast one, so a factor exp(x - s^2/2), of mean
# 1 over busy time, has mean exp(-s^2) over steps: a drifting run measured as runs are (its
# runner time over the model's) ran 0.9% fast at s = 9.2% and 2.9% at 17.1% (fid14's decode
# and prefill drift; 40 drawn runs: 0.9935 and 0.9752). The calibration runs measure 1.0 on
# average by construction, so the draws take exp(x + s^2/2): mean 1 over steps. False: the
# busy-time mean, as before fid16 (the kind-blind `DriftProcess.factor` keeps it).
DRIFT_STEP_MEAN = True


def _drift_mean_log(sigma: float) -> float:
    return sigma * sigma / 2 if DRIFT_STEP_MEAN else -sigma * sigma / 2


def _run_log(law: KindLaw, kind: str, unit: float,
             hold_units: Optional[Mapping[str, float]]) -> float:
    """A run's log speed for `kind` before the mean correction: run sigma x its own unit draw
    without a hold (as before fid16, to the bit); with one, the hold's share from the hold's
    unit draw (`hold_units`) and the rest, sqrt(run^2 - hold^2), from the run's own."""
    hold = law.hold_sigma(kind)
    if hold_units is None or hold <= 0:
        return law.run[kind] * unit
    return hold * hold_units[kind] + math.sqrt(law.run[kind] ** 2 - hold * hold) * unit


class KindNoisyModel:
    """`base`'s step times (a latency model: predict_totals) drawn on a `KindLaw`, each step
    by its kind (`kind_of(totals)`): times the run's factor for the kind (with `run_draw`:
    log-normal of mean 1, the two kinds correlated `run_rho`; else 1), a step jitter of the
    kind's sigma (mean 1), and the drift: log = sigma_kind x (sqrt(rho) C + sqrt(1 - rho)
    E_kind), C and E_kind unit Ornstein-Uhlenbeck processes (`DriftProcess`) of the law's
    correlation time, so each kind drifts with its own sigma and the two correlate `drift_rho`;
    their clock advances by each drawn step. One random stream per `seed`: deterministic.
    `hold_units`: the hold's unit draws (`KindLaw.draw_units`, one per hold), which the
    run's factor shares to the law's hold sigma (`_run_log`; None: the run alone).
    `run_units`: the run's own unit draws given (latency.sample_machines' stratified
    quantiles) instead of drawn; the stream still spends the two draws, so the rest of the
    run is the same either way.
    `predict`, `step_time` and the rest are `base`'s (the noise-free mean a scheduler sees),
    as NoisyLatencyModel's."""

    def __init__(self, base, law: KindLaw, kind_of: Callable, seed: int = 0,
                 run_draw: bool = True, hold_units: Optional[Mapping[str, float]] = None,
                 run_units: Optional[Mapping[str, float]] = None) -> None:
        self.base, self.law, self._kind_of = base, law, kind_of
        self._rng = random.Random(seed)
        unit = law.draw_units(self._rng)
        unit = dict(run_units) if run_units is not None else unit
        self.run_factor = {k: math.exp(_run_log(law, k, unit[k], hold_units)
                                       - law.run[k] ** 2 / 2)
                           if run_draw else 1.0 for k in KINDS}
        share = max(0.0, min(1.0, law.drift_rho))
        self._weights = (math.sqrt(share), math.sqrt(1.0 - share))
        tau = law.drift_tau_s
        self._common = DriftProcess(1.0, tau, seed=self._rng.randrange(2**31))
        self._own = {k: DriftProcess(1.0, tau, seed=self._rng.randrange(2**31)) for k in KINDS}
        self._processes = (self._common, *self._own.values())
        self._drifts = any(law.drift[k] > 0 for k in KINDS)
        # per kind: (run factor, jitter mean, jitter sigma, drift sigma, its mean correction)
        self._per_kind = {k: (self.run_factor[k], -law.step[k] ** 2 / 2, law.step[k],
                              law.drift[k], _drift_mean_log(law.drift[k])) for k in KINDS}

    def __getattr__(self, name):
        return getattr(self.base, name)

    def drift_factor(self, kind: str) -> float:
        s = self.law.drift[kind]
        if s <= 0:
            return 1.0
        a, b = self._weights
        return math.exp(s * (a * self._common.standard() + b * self._own[kind].standard())
                        + _drift_mean_log(s))

    def predict_totals(self, totals) -> float:
        kind = self._kind_of(totals)
        run, mu, sigma, drift, drift_mu = self._per_kind[kind]
        log = self._rng.gauss(mu, sigma)
        if drift > 0:  # drift_factor(kind)'s log
            a, b = self._weights
            log += drift * (a * self._common._x + b * self._own[kind]._x) + drift_mu
        seconds = self.base.predict_totals(totals) * run * math.exp(log)
        if self._drifts:  # DriftProcess.advance of each unit process, the decay shared
            decay = math.exp(-max(0.0, seconds) / self.law.drift_tau_s)
            spread = math.sqrt(1.0 - decay * decay)
            for p in self._processes:
                p._x = p._x * decay + spread * p._rng.gauss(0.0, 1.0)
        return seconds

    def predict(self, scheduler_output, context_lens) -> float:
        return self.base.predict(scheduler_output, context_lens)

    def step_time(self, chunks) -> float:
        return self.base.step_time(chunks)
