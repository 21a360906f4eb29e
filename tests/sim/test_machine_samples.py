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


# ---- the per-kind law (issue 36, fid16) ---------------------------------------------------------
DECODE = StepTotals.of_chunks([(1, 100), (1, 30)])
KINDS_V = {"run_sigma": 0.08, "step_sigma": 0.04, "drift_sigma": 0.1, "drift_tau_s": 3.0,
           "kinds": {"decode": {"run_sigma": 0.05, "step_sigma": 0.02, "drift_sigma": 0.0},
                     "prefill": {"run_sigma": 0.15, "step_sigma": 0.0, "drift_sigma": 0.0}},
           "kind_run_rho": 0.7, "kind_drift_rho": 0.0}


def test_a_per_kind_law_draws_each_kind_on_its_own_run_sigma():
    """With "kinds" in the variability every draw is a drift.KindNoisyModel on that law:
    prefill steps' run speeds spread by prefill's run sigma (stratified: the draws' logs are
    the normal quantiles times it, in a seeded order), decode's by decode's (in quantile
    order), the two correlated near run_rho; seeded, the same on every call. Probe: the
    kind-blind profile (no "kinds") draws NoisyLatencyModels, the same as before fid16."""
    from tokenweir.sim.drift import KindNoisyModel

    profile = {**PROFILE, "variability": KINDS_V}
    model = FittedLatencyModel.from_profile(profile)
    draws = sample_machines(profile, 16)
    assert all(isinstance(d, KindNoisyModel) for d in draws)
    q = sorted(NormalDist().inv_cdf((k + 0.5) / 16) for k in range(16))
    prefill = [math.log(d.predict_totals(STEP) / model.predict_totals(STEP)) for d in draws]
    decode = [math.log(d.run_factor["decode"]) for d in draws]
    assert decode == pytest.approx([0.05 * x - 0.05 ** 2 / 2 for x in q])
    # prefill (no step sigma, no drift): 0.15 x (0.7 q_k + sqrt(0.51) q_pi(k)), pi a permutation
    own = [((x + 0.15 ** 2 / 2) / 0.15 - 0.7 * u) / math.sqrt(0.51) for x, u in zip(prefill, q)]
    assert sorted(own) == pytest.approx(q, abs=1e-9) and own != pytest.approx(q)
    assert statistics.correlation(decode, prefill) == pytest.approx(0.7, abs=0.25)
    again = sample_machines(profile, 16)
    assert [d.predict_totals(DECODE) for d in draws[1:]] != []  # streams advance per draw
    assert [d.run_factor for d in again] == [d.run_factor for d in draws]
    blind = sample_machines({**PROFILE, "variability": {k: v for k, v in KINDS_V.items()
                                                        if not k.startswith("kind")}}, 4)
    assert all(isinstance(d, NoisyLatencyModel) for d in blind)


def test_without_kinds_the_draws_are_the_old_ones_to_the_bit():
    """A profile without "kinds": the pre-fid16 draws, step for step (scales from the
    stratified quantiles of run_sigma, jitter from seed + k; recomputed here by hand)."""
    v = {"run_sigma": 0.08, "step_sigma": 0.04}
    model = FittedLatencyModel.from_profile(PROFILE)
    draws = sample_machines({**PROFILE, "variability": v}, 5, seed=3)
    for k, d in enumerate(draws):
        scale = math.exp(0.08 * NormalDist().inv_cdf((k + 0.5) / 5) - 0.08 ** 2 / 2)
        ref = NoisyLatencyModel(model, 0.04, seed=3 + k, scale=scale)
        assert [d.predict_totals(STEP) for _ in range(50)] == [ref.predict_totals(STEP)
                                                              for _ in range(50)]
