"""benchmarks/slo_step_residuals.py (fid10): a kept run's step times as residuals over the
profile, replayed by class (prefill-bearing / decode-only) and rearranged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenweir.sim.latency import FittedLatencyModel, NoisyLatencyModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import sim_fidelity as sf  # noqa: E402
from benchmarks import slo_step_residuals as ssr  # noqa: E402
from fidelity_module import keep_light_run  # noqa: E402  (tests/sim/fidelity_module.py)

PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.010, "prefill_tokens": 0.0004, "decode_rows": 0.001},
           "overhead": {"const": 0.0004}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 1024, "model": "test", "num_layers": 30,
           "variability": {"step_sigma": 0.1}}


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    """A light run kept as --trace-dir keeps it: the simulator at PROFILE, each step times
    its own log-normal jitter of sigma 0.2 (its residuals), phases split as the engine's."""
    model = FittedLatencyModel.from_profile(PROFILE)
    return keep_light_run(sf, tmp_path_factory.mktemp("kept"),
                          NoisyLatencyModel(model, 0.2, seed=3))


def test_real_residuals_replay_the_kept_run_and_rearranged_ones_do_not(kept):
    """real/real is the kept run's clock (its TTFT p90 to the nanosecond: the schedule never
    parts); shuffled prefill residuals keep their multiset, change the run (the probe that
    order matters to the outcome here too); `one` is the profile at the run's speed."""
    out = ssr.run_variants(PROFILE, kept, ["real/real", "shuffled/real", "one/one"], 4,
                           workload="light")
    assert out["real/real"] == [pytest.approx(out["real"], abs=1e-9)]
    assert out["shuffled/real"][0] != pytest.approx(out["real"], abs=1e-6)
    assert len(out["matched"]) == 4 and len(set(out["matched"])) > 1


def test_arrangements(kept):
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert ssr.arranged(values, "reversed", 0, "P") == values[::-1]
    assert sorted(ssr.arranged(values, "shuffled", 0, "P")) == values
    assert ssr.arranged(values, "shuffled", 0, "P") != values
    assert ssr.arranged(values, "early", 0, "P") == [1.0, 2.0, None, None, None]
    assert ssr.arranged(values, "late", 0, "P") == [None, None, 4.0, 8.0, 16.0]
    smooth = ssr.arranged(values, "smooth", 0, "P")
    assert smooth[0] == 4.0 and [v / m for v, m in zip(values, smooth)] == \
        ssr.arranged(values, "detrended", 0, "P")


def test_residuals_are_the_real_cycles_over_the_profile(kept):
    """Each class's residuals: the kept steps' cycles over the profile at the run's speed; a
    kept run made at jitter sigma 0.2 has residuals that spread (and both classes present)."""
    from tokenweir.timeline.records import load_jsonl

    model = FittedLatencyModel.from_profile(
        sf.at_run_speed(PROFILE, sf.run_speed(PROFILE, kept)))
    res = ssr.residuals(load_jsonl(kept).steps, model)
    assert len(res["P"]) > 20 and len(res["D"]) > 20
    assert 0.1 < max(res["P"]) / min(res["P"]) - 1
    with pytest.raises(SystemExit):
        ssr.parse_variant("real/sideways")
