"""The machine's noise per step kind (issue 36, fid15): `drift.KindNoisyModel` draws decode
steps and prefill steps each on its own run, step and drift sigmas, `drift.fit_kind_law` fits
them from traced runs, and the fidelity suite's perfect simulator and speed-matched draws use
them where the profile records them (benchmarks/sim_fidelity.py)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import pytest
from fidelity_module import keep_light_run, loaded_sim_fidelity  # tests/sim/fidelity_module.py

from tokenweir.sim.calibrate_trace import TracedStep, local_ratios
from tokenweir.sim.drift import KindLaw, KindNoisyModel, fit_kind_law
from tokenweir.sim.latency import NoisyLatencyModel, StepTotals, step_kind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_trace import known_model  # noqa: E402

# decode steps tame, prefill steps wild: the shape fid14 measured on the real machine, wider
LAW = KindLaw(run={"decode": 0.05, "prefill": 0.15}, step={"decode": 0.03, "prefill": 0.10},
              drift={"decode": 0.06, "prefill": 0.18}, run_rho=0.6, drift_rho=0.6,
              drift_tau_s=3.0)
BLIND = KindLaw(run={"decode": 0.08, "prefill": 0.08}, step={"decode": 0.05, "prefill": 0.05},
                drift={"decode": 0.10, "prefill": 0.10}, run_rho=1.0, drift_rho=1.0,
                drift_tau_s=3.0)
DECODE = StepTotals.of_chunks([(1, 200)] * 4)
PREFILL = StepTotals.of_chunks([(16, 0), (1, 200), (1, 200)])


class RunnerOnly:
    """A model's runner time as its whole step time (the synthetic runs' runner)."""

    def __init__(self, model) -> None:
        self.model = model

    def predict_totals(self, totals) -> float:
        return self.model.runner_seconds(totals)


def synthetic_runs(law: KindLaw, runs: int = 40, steps: int = 1500) -> list[list[TracedStep]]:
    """Runs of a fixed step pattern (every 4th step a prefill) whose runner times are drawn
    on `law` (one KindNoisyModel per run, seeded by the run), as calibrate_trace traces them."""
    model = known_model()
    return [traced_run(KindNoisyModel(RunnerOnly(model), law, step_kind, seed=1000 + r), model,
                       steps)[0] for r in range(runs)]


def traced_run(noisy, model, steps: int, clock: float = 0.0, prefill: StepTotals = PREFILL,
               decode: StepTotals = DECODE) -> tuple[list[TracedStep], float]:
    """`steps` steps of the fixed pattern (every 4th a `prefill`) whose runner times `noisy`
    draws, as calibrate_trace traces them from `clock` (each step's cycle adds `model`'s
    overhead): the run, and the clock after its last step."""
    run = []
    for i in range(steps):
        totals = prefill if i % 4 == 0 else decode
        runner = noisy.predict_totals(totals)
        cycle = runner + model.overhead_seconds(totals)
        run.append(TracedStep(totals, runner, cycle, clock))
        clock += cycle
    return run, clock


def fitted(law: KindLaw) -> dict:
    model = known_model()
    runs = synthetic_runs(law)
    logs: dict[str, list[float]] = {"decode": [], "prefill": []}
    for run in runs:
        for s, r in zip(run, local_ratios(model, run)):
            if r:
                logs[step_kind(s.totals)].append(math.log(r))
    pooled = sorted(abs(x) for xs in logs.values() for x in xs)  # `variability`'s step_sigma
    return {**fit_kind_law(model, runs, step_kind, logs),
            "blind_step_sigma": 1.4826 * statistics.median(pooled)}


def test_the_model_draws_each_kind_on_its_law():
    """Over many seeds: each kind's run factor has its log-sd and mean 1, the two correlate
    run_rho; the drift factors have each kind's log-sd and correlate drift_rho; each step's
    jitter has its kind's sigma. Probe: the law with equal sigmas draws equal spreads."""
    base = RunnerOnly(known_model())
    run = {"decode": [], "prefill": []}
    drift = {"decode": [], "prefill": []}
    for seed in range(3000):
        m = KindNoisyModel(base, LAW, step_kind, seed=seed)
        for k in run:
            run[k].append(math.log(m.run_factor[k]))
            drift[k].append(math.log(m.drift_factor(k)))
    for k in run:
        assert statistics.pstdev(run[k]) == pytest.approx(LAW.run[k], rel=0.06)
        assert statistics.fmean(math.exp(x) for x in run[k]) == pytest.approx(1.0, abs=0.01)
        assert statistics.pstdev(drift[k]) == pytest.approx(LAW.drift[k], rel=0.06)
    assert statistics.correlation(run["decode"], run["prefill"]) == pytest.approx(0.6, abs=0.05)
    assert statistics.correlation(drift["decode"], drift["prefill"]) == pytest.approx(
        0.6, abs=0.05)
    quiet = KindLaw(LAW.run, LAW.step, {"decode": 0.0, "prefill": 0.0}, 0.6, 0.6, 20.0)
    m = KindNoisyModel(base, quiet, step_kind, seed=5, run_draw=False)
    for totals, kind in ((DECODE, "decode"), (PREFILL, "prefill")):
        logs = [math.log(m.predict_totals(totals) / base.predict_totals(totals))
                for _ in range(4000)]
        assert statistics.pstdev(logs) == pytest.approx(LAW.step[kind], rel=0.06)
    assert m.run_factor == {"decode": 1.0, "prefill": 1.0}  # run_draw False: no run draw
    same = KindNoisyModel(base, BLIND, step_kind, seed=9)
    assert same.run_factor["decode"] == pytest.approx(same.run_factor["prefill"], rel=1e-12)


def test_the_fit_recovers_each_kinds_scatter():
    """Runs drawn on LAW (prefill 2-3x decode in every sigma): the per-kind fit finds each
    sigma and both correlations; the kind-blind fit (`variability`) finds one step sigma
    between the two. Probe: runs drawn on a law with equal sigmas fit equal sigmas, so the
    split comes from the runs, not from the fit. The tolerances are the fit's own biases
    (40 runs of ~28 s, measured): step sigma +10-14% (neighbours' drift leaks into the local
    ratios), drift -17-20% (3-s window means smooth a 3-s correlation time), run sigma +20%
    (a run's mean drift counts in its run log)."""
    f = fitted(LAW)
    kinds = f["kinds"]
    for kind in ("decode", "prefill"):
        assert kinds[kind]["step_sigma"] == pytest.approx(LAW.step[kind], rel=0.2)
        assert kinds[kind]["run_sigma"] == pytest.approx(LAW.run[kind], rel=0.3)
        assert kinds[kind]["drift_sigma"] == pytest.approx(LAW.drift[kind], rel=0.3)
        assert kinds[kind]["num_runs"] == 40
    assert f["kind_run_rho"] == pytest.approx(0.6, abs=0.2)
    assert f["kind_drift_rho"] == pytest.approx(0.6, abs=0.2)
    assert (kinds["decode"]["step_sigma"] < f["blind_step_sigma"]
            < kinds["prefill"]["step_sigma"])
    same = fitted(BLIND)["kinds"]
    for key in ("step_sigma", "run_sigma", "drift_sigma"):
        assert same["prefill"][key] == pytest.approx(same["decode"][key], rel=0.3)


# ---- the fidelity suite draws on it --------------------------------------------------------
PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.010, "prefill_tokens": 0.0004, "decode_rows": 0.001},
           "overhead": {"const": 0.0004}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 1024, "model": "test", "num_layers": 30,
           "variability": {"run_sigma": 0.08, "step_sigma": 0.05, "drift_sigma": 0.1,
                           "drift_tau_s": 4.0,
                           "kinds": {k: {"run_sigma": LAW.run[k], "step_sigma": LAW.step[k],
                                         "drift_sigma": LAW.drift[k]} for k in LAW.run},
                           "kind_run_rho": 0.6, "kind_drift_rho": 0.6}}


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_kind_noise")


@pytest.fixture(scope="module")
def kept(fid, tmp_path_factory):
    """One kept validation run of `light` (quick): the simulator at PROFILE, as the engine
    traces it."""
    from tokenweir.sim.latency import FittedLatencyModel

    d = tmp_path_factory.mktemp("kept")
    keep_light_run(fid, d, FittedLatencyModel.from_profile(PROFILE))
    return d


def machines_drawn(fid, kept, monkeypatch, profile) -> list:
    """The latency models the perfect simulator and the speed-matched floor ran on."""
    seen, real_run_sim = [], fid.run_sim

    def spy(w, machine, *rest, **kw):
        seen.append(machine)
        return real_run_sim(w, machine, *rest, **kw)

    monkeypatch.setattr(fid, "run_sim", spy)
    args = argparse.Namespace(perfect_suites=1, matched_suites=1, repeats=1, sim_samples=1,
                              seed=0, validation_seeds=1)
    prediction = {k: 1.0 for k in fid.METRICS}
    fid.perfect_simulator(args, "light", profile, kept, prediction)
    fid.perfect_speed_matched(args, "light", profile, kept, prediction)
    return seen


def test_the_floor_draws_each_kind_on_the_profiles_law(fid, kept, monkeypatch):
    """With the per-kind law in the profile, every run of the perfect simulator and of the
    speed-matched floor draws on it (the floor's runs with a run draw, the speed-matched ones
    without); `kind_blind` (--kind-blind-noise) and a profile without "kinds" draw on the
    kind-blind law, as before. Probe: the kind-blind runs are NoisyLatencyModels."""
    law = KindLaw.from_variability(PROFILE["variability"])
    assert law.step == LAW.step and law.drift == LAW.drift and law.run_rho == 0.6
    seen = machines_drawn(fid, kept, monkeypatch, PROFILE)
    assert len(seen) == 3 and all(isinstance(m, KindNoisyModel) and m.law == law for m in seen)
    assert seen[0].run_factor != {"decode": 1.0, "prefill": 1.0}  # the floor's run draw
    assert all(m.run_factor == {"decode": 1.0, "prefill": 1.0} for m in seen[1:])
    blind = machines_drawn(fid, kept, monkeypatch, fid.kind_blind(PROFILE))
    assert len(blind) == 3 and all(isinstance(m, NoisyLatencyModel) for m in blind)
    still = fid.without_drift(PROFILE)  # --no-floor-drift: no kind drifts
    assert KindLaw.from_variability(still["variability"]).drift == {"decode": 0.0,
                                                                    "prefill": 0.0}
