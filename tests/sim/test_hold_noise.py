"""The hold (issue 36, fid16): runs collected back to back in one invocation share the
machine's speed. `drift.infer_holds` groups runs by their clocks and recorded holds,
`drift.fit_hold_split` splits the run sigma into the part a hold shares and each run's own,
`drift.KindNoisyModel(hold_units=...)` draws runs of one hold on a shared part, and the
fidelity suite's perfect simulator draws one hold part per hold of the validation runs
(benchmarks/sim_fidelity.py: `suite_holds`)."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest
from fidelity_module import loaded_sim_fidelity  # tests/sim/fidelity_module.py

from tokenweir.sim.calibrate_trace import TracedStep, run_holds, with_drift
from tokenweir.sim.drift import (HOLD_GAP_S, HOLD_SPAN_S, KindLaw, KindNoisyModel, RunStamp,
                                 fit_hold_split, infer_holds)
from tokenweir.sim.latency import StepTotals, step_kind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_trace import known_model  # noqa: E402
from test_kind_noise import traced_run  # noqa: E402

KINDS = ("decode", "prefill")
# prefill's run speed mostly shared by its hold, decode's half
LAW = KindLaw(run={"decode": 0.06, "prefill": 0.10}, step={"decode": 0.02, "prefill": 0.04},
              drift={"decode": 0.0, "prefill": 0.0}, run_rho=0.7, drift_rho=0.0,
              drift_tau_s=3.0, hold={"decode": 0.06 / math.sqrt(2), "prefill": 0.09})


# ---- grouping runs into holds ------------------------------------------------------------------
def test_holds_follow_the_clock_the_span_and_the_recorded_hold():
    """Back to back (gaps under HOLD_GAP_S) within HOLD_SPAN_S of the hold's first run: one
    hold; a longer gap (another invocation), a run past the span, a different recorded hold
    or a run on another clock (starting before the previous run ended) starts a new one.
    The answer follows the runs' order given, not their order in time."""
    a = [RunStamp(0, 30), RunStamp(32, 60), RunStamp(62, 90)]  # one invocation, 1.5 min
    assert infer_holds(a) == [0, 0, 0]
    gap = [RunStamp(0, 30), RunStamp(30 + HOLD_GAP_S + 1, 80)]
    assert infer_holds(gap) == [0, 1]
    span = [RunStamp(t, t + 28) for t in range(0, int(HOLD_SPAN_S) + 60, 30)]
    assert infer_holds(span)[-1] == 1 and infer_holds(span)[0] == 0
    assert max(s.start for s, h in zip(span, infer_holds(span)) if h == 0) <= HOLD_SPAN_S
    ids = [RunStamp(0, 30, "x"), RunStamp(31, 60, "y"), RunStamp(61, 90, "y")]
    assert infer_holds(ids) == [0, 1, 1]
    other_clock = [RunStamp(0, 30), RunStamp(10, 40)]
    assert infer_holds(other_clock) == [0, 1]
    shuffled = [a[2], a[0], RunStamp(500, 530), a[1]]
    assert infer_holds(shuffled) == [0, 0, 1, 0]


def test_a_traces_hold_comes_from_its_steps():
    """calibrate_trace.run_holds reads each trace's first step's start and last step's end."""
    step = StepTotals.of_chunks([(1, 100)])
    runs = [[TracedStep(step, 0.01, 0.012, t0 + 0.012 * i) for i in range(100)]
            for t0 in (0.0, 2.0, 500.0)]
    assert run_holds(runs) == [0, 0, 1]
    assert run_holds(runs, ["a", "b", "b"]) == [0, 1, 2]  # recorded holds decide too


# ---- the fit ---------------------------------------------------------------------------------
def drawn_logs(law: KindLaw, holds: int, per_hold: int, seed: int = 3) -> tuple[list, list]:
    """Per run, its kinds' log run factors drawn on `law` (hold units shared per hold)."""
    base = _Const()
    rng = random.Random(seed)
    logs, labels = [], []
    for h in range(holds):
        units = law.draw_units(rng)
        for r in range(per_hold):
            m = KindNoisyModel(base, law, step_kind, seed=rng.randrange(2**31), hold_units=units)
            logs.append({k: math.log(m.run_factor[k]) for k in KINDS})
            labels.append(h)
    return logs, labels


class _Const:
    def predict_totals(self, totals) -> float:
        return 0.01


def test_the_model_draws_a_shared_hold_part_and_keeps_each_runs_sigma():
    """Runs of one hold correlate hold^2 / run^2 per kind; every run alone still has the
    law's run sigma and mean factor 1. Probe: without hold units (or a law without a hold
    part) two runs' factors do not correlate, and the draw is the pre-fid16 one to the bit."""
    logs, holds = drawn_logs(LAW, 1500, 2)
    for k in KINDS:
        xs = [x[k] for x in logs]
        assert statistics.pstdev(xs) == pytest.approx(LAW.run[k], rel=0.06)
        assert statistics.fmean(math.exp(x) for x in xs) == pytest.approx(1.0, abs=0.01)
        firsts, seconds = xs[0::2], xs[1::2]
        want = LAW.hold[k] ** 2 / LAW.run[k] ** 2
        assert statistics.correlation(firsts, seconds) == pytest.approx(want, abs=0.06)
    alone = KindLaw(LAW.run, LAW.step, LAW.drift, LAW.run_rho, LAW.drift_rho, LAW.drift_tau_s)
    lone, _ = drawn_logs(alone, 1500, 2)
    assert abs(statistics.correlation([x["prefill"] for x in lone[0::2]],
                                      [x["prefill"] for x in lone[1::2]])) < 0.06
    for seed in range(5):  # no hold part: the same draw as a law without the field
        units = {"decode": 1.5, "prefill": -2.0}
        with_units = KindNoisyModel(_Const(), alone, step_kind, seed=seed, hold_units=units)
        plain = KindNoisyModel(_Const(), alone, step_kind, seed=seed)
        assert with_units.run_factor == plain.run_factor


def test_the_fit_recovers_both_parts():
    """Runs drawn in 60 holds of 3: the fit finds each kind's hold part; the same runs with
    their holds shuffled across (each run its own hold's label taken from another hold) find
    none, and one hold is unidentified (0)."""
    logs, holds = drawn_logs(LAW, 60, 3)
    split = fit_hold_split(logs, holds)
    for k in KINDS:
        assert split[k] == pytest.approx(LAW.hold[k], rel=0.25)
    mixed = [holds[(i * 7) % len(holds)] for i in range(len(holds))]  # 7 is prime to 180
    assert all(v < 0.5 * LAW.hold[k] for k, v in fit_hold_split(logs, mixed).items())
    assert fit_hold_split(logs, [0] * len(logs)) == {"decode": 0.0, "prefill": 0.0}
    independent, _ = drawn_logs(KindLaw(LAW.run, LAW.step, LAW.drift, LAW.run_rho, 0.0, 3.0),
                                60, 3)
    assert all(v < 0.5 * LAW.hold[k] for k, v in fit_hold_split(independent, holds).items())


def test_calibration_fits_the_hold_part_from_traced_runs():
    """End to end: runs traced on LAW, in holds of 3 back to back and holds far apart;
    calibrate_trace.with_drift with their holds records each kind's hold_sigma near the law's
    (and num_holds); without holds, no hold_sigma key (profiles as before fid16)."""
    model = known_model()
    decode, prefill = StepTotals.of_chunks([(1, 200)] * 4), StepTotals.of_chunks([(16, 0)])
    rng = random.Random(11)
    runs, clock = [], 0.0
    for h in range(40):
        units = LAW.draw_units(rng)
        clock += 10_000.0
        for r in range(3):
            noisy = KindNoisyModel(_Runner(model), LAW, step_kind, seed=rng.randrange(2**31),
                                   hold_units=units)
            run, clock = traced_run(noisy, model, 200, clock, prefill, decode)
            runs.append(run)
            clock += 2.0
    stalled = [[False] * len(r) for r in runs]
    holds = run_holds(runs)
    assert holds == [i // 3 for i in range(len(runs))]
    v = with_drift(model, runs, stalled, holds)
    assert v["num_holds"] == 40
    for k in KINDS:
        assert v["kinds"][k]["hold_sigma"] == pytest.approx(LAW.hold[k], rel=0.3)
    assert "hold_sigma" not in with_drift(model, runs, stalled)["kinds"]["decode"]


class _Runner:
    def __init__(self, model) -> None:
        self.model = model

    def predict_totals(self, totals) -> float:
        return self.model.runner_seconds(totals)


# ---- the fidelity suite's floor ----------------------------------------------------------------
PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.010, "prefill_tokens": 0.0004, "decode_rows": 0.001},
           "overhead": {"const": 0.0004}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 1024, "model": "test", "num_layers": 30,
           "variability": {"run_sigma": 0.12, "step_sigma": 0.02, "drift_sigma": 0.0,
                           "drift_tau_s": 4.0,
                           "kinds": {k: {"run_sigma": 0.12, "step_sigma": 0.02,
                                         "drift_sigma": 0.0, "hold_sigma": 0.12}
                                     for k in KINDS},
                           "kind_run_rho": 0.9, "kind_drift_rho": 0.0}}


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_hold_noise")


def keep_runs(fid, directory: Path, gap_s: float) -> None:
    """Kept validation runs of `light` (quick, seeds 1-3), simulated on PROFILE's model and
    traced as the engine traces them, each starting `gap_s` after the previous one ended."""
    from tokenweir.sim.latency import FittedLatencyModel
    from tokenweir.timeline.records import write_jsonl

    w, model = fid.WORKLOADS["light"], FittedLatencyModel.from_profile(PROFILE)
    clock = 0.0
    for seed in (1, 2, 3):
        records, trace = fid.run_sim(w, model, fid.make_specs(w, seed, quick=True))
        first = trace.steps[0]["start"]
        for s in trace.steps:
            s["phases"] = {"schedule": 0.0004, "forward": s["duration"] - 0.0004}
            s["start"] += clock - first
        clock = max(s["start"] + s["duration"] for s in trace.steps) + gap_s
        path = fid.real_path(directory, "light", seed)
        write_jsonl(trace, path)
        fid.records_path(path).write_text(json.dumps(
            {"workload": "light", "seed": seed, "quick": True, "records": records}))


@pytest.fixture(scope="module")
def layouts(fid, tmp_path_factory):
    """The same three runs kept back to back (one hold) and hours apart (three)."""
    together, apart = tmp_path_factory.mktemp("together"), tmp_path_factory.mktemp("apart")
    keep_runs(fid, together, 2.0)
    keep_runs(fid, apart, 10_000.0)
    return together, apart


def floor_args(suites: int) -> argparse.Namespace:
    return argparse.Namespace(perfect_suites=suites, matched_suites=0, repeats=1,
                              sim_samples=1, seed=0, validation_seeds=3)


def test_kept_runs_back_to_back_share_a_hold(fid, layouts):
    together, apart = layouts
    traces = fid.validation_paths(floor_args(1), together, "light", 1)
    assert fid.suite_holds(together, traces) == [0, 0, 0]
    traces = fid.validation_paths(floor_args(1), apart, "light", 1)
    assert fid.suite_holds(apart, traces) == [0, 1, 2]


def machines(fid, directory, profile, monkeypatch, suites=2) -> list:
    seen, real_run_sim = [], fid.run_sim

    def spy(w, machine, *rest, **kw):
        seen.append(machine)
        return real_run_sim(w, machine, *rest, **kw)

    monkeypatch.setattr(fid, "run_sim", spy)
    fid.perfect_simulator(floor_args(suites), "light", profile, directory,
                          {k: 1.0 for k in fid.METRICS})
    monkeypatch.undo()
    return seen


def test_the_floor_draws_one_hold_part_per_hold(fid, layouts, monkeypatch):
    """Runs of one hold share their suite's hold draw, runs of separate holds do not, and
    each suite draws anew. Probe: --no-floor-holds (`without_holds`) draws no hold part."""
    together, apart = layouts
    seen = machines(fid, together, PROFILE, monkeypatch)
    assert len(seen) == 6
    assert all(isinstance(m, KindNoisyModel) for m in seen)
    factors = [m.run_factor["decode"] for m in seen]
    # hold_sigma == run_sigma: the whole run speed is the hold's
    assert factors[0] == factors[1] == factors[2] != factors[3] == factors[4] == factors[5]
    seen = machines(fid, apart, PROFILE, monkeypatch)
    assert len({m.run_factor["decode"] for m in seen}) == 6
    seen = machines(fid, together, fid.without_holds(PROFILE), monkeypatch)
    assert len({m.run_factor["decode"] for m in seen}) == 6


def test_the_floor_widens_when_the_runs_share_a_hold(fid, layouts):
    """Over 24 suites, the spread of the synthetic runs' mean TTFT p50 and TPOT p50 (which
    follow the prefill and decode speed): wider for three runs of one hold than for the same
    runs in three holds (the mean of three shared speeds does not average out; sqrt(3)x
    with the whole run sigma the hold's). Probe: without the hold part the two layouts give
    the same suites, to the bit (the draws do not depend on the layout)."""
    together, apart = layouts
    prediction = {k: 1.0 for k in fid.METRICS}

    def suites(directory, profile, count):
        return fid.perfect_simulator(floor_args(count), "light", profile, directory, prediction)

    def spread(drawn, key):
        return statistics.pstdev(math.log(1 + e[key]) for e in drawn)

    shared, separate = suites(together, PROFILE, 24), suites(apart, PROFILE, 24)
    for key in ("ttft_p50_ms", "tpot_p50_ms"):
        assert spread(shared, key) > 1.3 * spread(separate, key), key
    plain = fid.without_holds(PROFILE)
    assert suites(together, plain, 4) == suites(apart, plain, 4)


def test_more_runs_in_holds_refit_the_hold_part(fid, tmp_path):
    """--hold-runs (`calibrate_trace.refit_holds`): runs kept in four holds, each hold's runs
    slowed by its own factor (log +0.10, -0.10, +0.05, -0.05), give each kind the rms of the
    hold logs (within a hold the two runs are the same simulation: no run part), capped at the
    profile's run sigma; the step model and the other sigmas stay. The runs lie back to back
    on one clock, so the holds their collectors recorded decide. Probe: the same runs
    recorded as one hold give 0."""
    import math as m

    from tokenweir.sim.calibrate_trace import refit_holds
    from tokenweir.sim.latency import FittedLatencyModel
    from tokenweir.timeline.records import write_jsonl

    w, model = fid.WORKLOADS["light"], FittedLatencyModel.from_profile(PROFILE)
    paths, clock = [], 0.0
    for h, log in enumerate((0.10, -0.10, 0.05, -0.05)):
        for r in range(2):
            _, trace = fid.run_sim(w, model, fid.make_specs(w, 1, quick=True))
            first = trace.steps[0]["start"]
            for s in trace.steps:
                forward = (s["duration"] - 0.0004) * m.exp(log)
                s["phases"] = {"schedule": 0.0004, "forward": forward}
                s["start"] += clock - first
                s["duration"] = forward + 0.0004
            clock = max(s["start"] + s["duration"] for s in trace.steps) + 2.0
            paths.append(str(tmp_path / f"h{h}-{r}.jsonl"))
            write_jsonl(trace, paths[-1])
    profile = {**PROFILE, "traces": []}
    assert clock < HOLD_SPAN_S  # one span: only the recorded holds part them
    refit = refit_holds(profile, paths, [f"h{i // 2}" for i in range(len(paths))])
    want = m.sqrt(sum(x * x for x in (0.10, -0.10, 0.05, -0.05)) / 4)
    for k in KINDS:
        law = refit["variability"]["kinds"][k]
        assert law["hold_sigma"] == pytest.approx(want, rel=0.1)
        assert law["run_sigma"] == PROFILE["variability"]["kinds"][k]["run_sigma"]
    assert refit["coefficients"] == PROFILE["coefficients"]
    assert refit["variability"]["num_holds"] == 4
    one = refit_holds(profile, paths, ["same"] * len(paths))  # recorded: one hold
    assert all(law["hold_sigma"] == 0.0 for law in one["variability"]["kinds"].values())


# ---- the drift's mean over steps (fid16) ----------------------------------------------------------
def test_a_drifting_run_measures_the_profiles_speed_on_average():
    """A run drawn with drift alone (no run draw, no step jitter), measured as real runs are
    (its runner time over the model's, over all its steps), takes the model's time on average
    over 40 runs: the drift's mean correction makes its mean 1 over steps, not over busy
    time (with the old correction, exp(-s^2): 0.975 at fid14's prefill drift of 17%). Probe:
    DRIFT_STEP_MEAN False gives the old mean, below 0.98."""
    import tokenweir.sim.drift as drift

    class Const:
        def predict_totals(self, totals) -> float:
            return 0.2 if step_kind(totals) == "prefill" else 0.04

    prefill, decode = StepTotals.of_chunks([(128, 0)]), StepTotals.of_chunks([(1, 100)] * 4)
    zero = {"decode": 0.0, "prefill": 0.0}
    law = KindLaw(zero, zero, {"decode": 0.171, "prefill": 0.171}, 0.0, 1.0, 4.5)

    def mean_ratio() -> float:
        ratios = []
        for seed in range(40):
            m = KindNoisyModel(Const(), law, step_kind, seed=seed, run_draw=False)
            steps = [prefill if i % 4 == 0 else decode for i in range(3000)]
            ratios.append(sum(m.predict_totals(t) for t in steps)
                          / sum(Const().predict_totals(t) for t in steps))
        return statistics.fmean(ratios)

    assert mean_ratio() == pytest.approx(1.0, abs=0.01)
    old = drift.DRIFT_STEP_MEAN
    try:
        drift.DRIFT_STEP_MEAN = False
        assert mean_ratio() < 0.98
    finally:
        drift.DRIFT_STEP_MEAN = old
