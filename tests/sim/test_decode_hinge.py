"""The decode-context hinge (issue 36, fid7): latency.fitted_features' "decode_context_hinge"
(the decodes' context tokens past a knee) and calibrate_trace.choose_hinge, which picks the
knee by held-out error and keeps none unless it lowers that error.

The planted case: synthetic engine traces (test_calibrate_trace.engine_like_trace) of a
latency model whose decode attention costs more per token past 1,000 context tokens; the
calibration finds that knee and recovers the coefficients. Its pair: the same traces with no
hinge planted get none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenweir.sim.calibrate_trace import HINGE_KNEES, calibrate_from_traces, traced_steps
from tokenweir.sim.latency import FittedLatencyModel, StepTotals, fitted_features
from tokenweir.timeline.records import load_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_trace import OVERHEAD, RUNNER, engine_like_trace  # noqa: E402

KNEE = 1000
HINGED = {**RUNNER, "decode_context_hinge": 4e-6}


def hinged_model() -> FittedLatencyModel:
    return FittedLatencyModel(HINGED, kv_bytes_per_token=46080, max_model_len=2048,
                              overhead=OVERHEAD, decode_hinge_tokens=KNEE)


def test_the_hinge_feature_counts_decode_context_past_the_knee_only():
    steps = StepTotals.of_chunks([(1, 700), (1, 500), (40, 100)])  # 1,200 decode context
    assert fitted_features(steps, 1000)[-1] == 200.0
    assert fitted_features(steps, 1500)[-1] == 0.0
    assert fitted_features(steps)[-1] == 0.0  # no knee: no hinge
    model = hinged_model()
    flat = FittedLatencyModel(RUNNER, overhead=OVERHEAD)
    assert model.runner_seconds(steps) - flat.runner_seconds(steps) == pytest.approx(200 * 4e-6)


def test_a_profile_without_a_knee_predicts_as_before():
    """Profiles written before the hinge have neither the coefficient nor the knee: the same
    floats, bit for bit (the hinge adds 0.0)."""
    profile = {"coefficients": RUNNER, "overhead": OVERHEAD}
    model = FittedLatencyModel.from_profile(profile)
    assert model.decode_hinge_tokens == 0
    for chunks in ([(1, 3000), (1, 2000)], [(100, 50), (1, 300)], [(1, 10)]):
        t = StepTotals.of_chunks(chunks)
        weights = [RUNNER.get(f, 0.0) for f in ("const", "prefill_tokens", "decode_rows",
                                                 "prefill_attention", "decode_context",
                                                 "prefill_rows", "multi_decode",
                                                 "prefill_self_attention")]
        before = sum(w * x for w, x in zip(weights, fitted_features(t)[:-1]))
        assert model.runner_seconds(t) == before


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("hinge")
    planted, flat = d / "planted.jsonl", d / "flat.jsonl"
    engine_like_trace(planted, seed=5, model=hinged_model())
    engine_like_trace(flat, seed=5)
    return planted, flat


def test_calibration_finds_a_planted_hinge(traces):
    planted, _ = traces
    steps = traced_steps(load_jsonl(planted))
    past = [s for s in steps if s.totals.decode_context > KNEE]
    assert len(past) > 50 and len(past) < len(steps) - 50  # the knee lies inside the runs
    assert KNEE in HINGE_KNEES
    profile = calibrate_from_traces([str(planted)], holdout_every=5, hinge_tokens=None)
    assert profile["decode_hinge_tokens"] == KNEE
    for name, value in HINGED.items():
        assert profile["coefficients"][name] == pytest.approx(value, rel=1e-4), name
    errors = profile["hinge_choice"]
    assert errors[str(KNEE)] < 1e-6 < errors["0"]  # without the hinge the fit errs
    assert FittedLatencyModel.from_profile(profile).decode_hinge_tokens == KNEE


def test_calibration_keeps_no_hinge_where_none_is_planted(traces):
    _, flat = traces
    profile = calibrate_from_traces([str(flat)], holdout_every=5, hinge_tokens=None)
    assert profile["decode_hinge_tokens"] == 0
    assert profile["coefficients"]["decode_context_hinge"] == 0.0
    assert set(profile["hinge_choice"]) == {str(k) for k in HINGE_KNEES}
    for name, value in RUNNER.items():
        assert profile["coefficients"][name] == pytest.approx(value, rel=1e-4), name
