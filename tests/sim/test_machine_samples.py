"""latency.sample_machines (issue 16): draws of the machine a trace-fitted profile was
measured on, each a run-level speed and per-step jitter, for a simulator whose mean over the
draws is compared with the mean of real runs."""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

import pytest

from tokenweir.sim.latency import (FittedLatencyModel, NoisyLatencyModel, StepTotals,
                                   sample_machines)

PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.01, "prefill_tokens": 4e-4, "decode_rows": 1e-3},
           "overhead": {"const": 4e-4}}
STEP = StepTotals.of_chunks([(64, 0), (1, 100), (1, 30)])


def test_without_variability_every_draw_is_the_deterministic_model():
    base = FittedLatencyModel.from_profile(PROFILE).predict_totals(STEP)
    for profile in (PROFILE, {**PROFILE, "variability": {"run_sigma": 0, "step_sigma": 0}}):
        draws = sample_machines(profile, 3)
        assert len(draws) == 3
        assert all(isinstance(d, FittedLatencyModel) for d in draws)
        assert {d.predict_totals(STEP) for d in draws} == {base}
    noisy = {**PROFILE, "variability": {"run_sigma": 0.1, "step_sigma": 0.05}}
    (one,) = sample_machines(noisy, 1)  # one draw: the profile's own model
    assert one.predict_totals(STEP) == base
    with pytest.raises(ValueError, match="count"):
        sample_machines(PROFILE, 0)


def test_run_speeds_are_stratified_quantiles_of_mean_one():
    base = FittedLatencyModel.from_profile(PROFILE).predict_totals(STEP)
    sigma = 0.1
    draws = sample_machines({**PROFILE, "variability": {"run_sigma": sigma,
                                                        "step_sigma": 0.0}}, 4)
    speeds = [d.predict_totals(STEP) / base for d in draws]
    expected = [math.exp(sigma * NormalDist().inv_cdf((k + 0.5) / 4) - sigma ** 2 / 2)
                for k in range(4)]
    assert speeds == pytest.approx(expected)
    assert speeds == sorted(speeds) and speeds[0] < 0.9 < 1.1 < speeds[-1]
    # a draw's speed holds for every step of its run; the forecast (predict) stays the mean
    assert draws[0].predict_totals(STEP) == draws[0].predict_totals(STEP)
    assert draws[0].step_time([(64, 0), (1, 100), (1, 30)]) == pytest.approx(base)


def test_step_jitter_is_seeded_per_draw_and_of_mean_one():
    profile = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.05}}
    base = FittedLatencyModel.from_profile(profile).predict_totals(STEP)
    first = [[d.predict_totals(STEP) for _ in range(2000)]
             for d in sample_machines(profile, 2, seed=7)]
    again = [[d.predict_totals(STEP) for _ in range(2000)]
             for d in sample_machines(profile, 2, seed=7)]
    assert first == again  # deterministic for a seed
    assert first[0] != first[1]  # each draw its own stream
    logs = [math.log(x / base) for x in first[0]]
    assert statistics.stdev(logs) == pytest.approx(0.05, rel=0.1)
    assert statistics.fmean(first[0]) / base == pytest.approx(1.0, abs=0.005)
    with pytest.raises(ValueError):
        NoisyLatencyModel(FittedLatencyModel.from_profile(profile), 0.05, scale=0)
