"""tokenweir/sim/drift.py: the machine's speed drifting inside a run, fitted from traces
(`fit_drift`) and drawn in simulations (`DriftProcess` through NoisyLatencyModel)."""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path

import pytest

from tokenweir.sim.calibrate_trace import step_kind, traced_steps
from tokenweir.sim.drift import DriftProcess, fit_drift
from tokenweir.sim.latency import NoisyLatencyModel, StepTotals

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_trace import known_model  # noqa: E402


def test_the_process_has_the_stated_law():
    """Stationary: the factor's mean is 1, its log's sigma is `sigma`, and two looks tau
    apart correlate exp(-1). Probe: looks 10 tau apart are uncorrelated."""
    sigma, tau = 0.1, 5.0
    logs_now, logs_tau, logs_far = [], [], []
    for seed in range(3000):
        p = DriftProcess(sigma, tau, seed=seed)
        logs_now.append(math.log(p.factor()))
        p.advance(tau / 2)
        p.advance(tau / 2)  # two halves: the same law as one whole step
        logs_tau.append(math.log(p.factor()))
        p.advance(9 * tau)
        logs_far.append(math.log(p.factor()))
    factors = [math.exp(x) for x in logs_now]
    assert statistics.fmean(factors) == pytest.approx(1.0, abs=0.01)
    assert statistics.pstdev(logs_now) == pytest.approx(sigma, rel=0.06)
    assert statistics.correlation(logs_now, logs_tau) == pytest.approx(math.exp(-1), abs=0.05)
    assert abs(statistics.correlation(logs_now, logs_far)) < 0.06


def test_a_noisy_model_without_drift_draws_as_before():
    """drift None: the same random stream and the same step times as the model always drew
    (base * scale * exp(N(-s^2/2, s))). With drift: the same jitter stream, times the drift,
    whose clock advanced by each drawn step."""
    model = known_model()
    totals = StepTotals.of_chunks([(1, 300), (1, 200), (64, 0)])
    base = model.predict_totals(totals)
    plain = NoisyLatencyModel(model, 0.05, seed=7, scale=1.1)
    rng = random.Random(7)
    expected = [base * 1.1 * math.exp(rng.gauss(-0.05 ** 2 / 2, 0.05)) for _ in range(50)]
    assert [plain.predict_totals(totals) for _ in range(50)] == expected
    drift, twin = DriftProcess(0.2, 1.0, seed=3), DriftProcess(0.2, 1.0, seed=3)
    drifting = NoisyLatencyModel(model, 0.05, seed=7, scale=1.1, drift=drift)
    for e in expected:
        f = twin.factor()
        assert drifting.predict_totals(totals) == pytest.approx(e * f, rel=1e-12)
        twin.advance(e * f)
    assert drift.factor() == twin.factor()


def drifting_runs(tmp_path, sigma: float, tau: float, runs: int = 6) -> list:
    """Traced steps of runs whose machine drifts (sigma, tau) with 3% step jitter."""
    from test_calibrate_trace import engine_like_trace

    out = []
    for k in range(runs):
        _, trace = engine_like_trace(tmp_path / f"d{k}.jsonl", seed=40 + k, noise=0.03)
        steps = traced_steps(trace)
        if sigma:
            p = DriftProcess(sigma, tau, seed=100 + k)
            for i, s in enumerate(steps):
                f = p.factor()
                p.advance(s.cycle * f)
                steps[i] = type(s)(s.totals, s.runner * f, s.cycle + s.runner * (f - 1), s.start)
        out.append(steps)
    return out


def test_fit_recovers_a_drift_and_finds_none_where_there_is_none(tmp_path):
    """Runs drifting 10% with a 6-s correlation time: the fit finds ~10% and a correlation
    time of seconds. The probe: the same runs without drift (the same 3% step jitter) fit
    a drift under 2%."""
    model = known_model()
    none = fit_drift(model, drifting_runs(tmp_path, 0.0, 1.0), step_kind, 0.03)
    assert none["num_windows"] > 20 and none["drift_sigma"] < 0.02
    fitted = fit_drift(model, drifting_runs(tmp_path, 0.10, 6.0), step_kind, 0.03)
    assert fitted["drift_sigma"] == pytest.approx(0.10, rel=0.35)
    assert 2.0 < fitted["drift_tau_s"] < 20.0


def test_a_trace_fitted_profile_carries_the_drift(tmp_path):
    from test_calibrate_trace import engine_like_trace

    from tokenweir.sim.calibrate import format_report
    from tokenweir.sim.calibrate_trace import calibrate_from_traces

    paths = []
    for k in range(2):
        engine_like_trace(tmp_path / f"t{k}.jsonl", seed=30 + k, noise=0.03)
        paths.append(str(tmp_path / f"t{k}.jsonl"))
    v = calibrate_from_traces(paths, holdout_every=5)["variability"]
    assert {"drift_sigma", "drift_tau_s", "num_windows"} <= set(v) and v["num_windows"] > 0
    assert "drift inside runs" in format_report(calibrate_from_traces(paths))
