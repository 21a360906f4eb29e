"""Issue 36's counts judge prefix hits as events (fid10): the requests whose prefix-cache
lookup hit (`prefix_hit_events`), with the tokens they found printed beside, not judged."""

from __future__ import annotations

import pytest
from fidelity_module import loaded_sim_fidelity  # tests/sim/fidelity_module.py

from tokenweir.sim.latency import FittedLatencyModel

PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.010, "prefill_tokens": 0.0004, "decode_rows": 0.001},
           "overhead": {"const": 0.0004}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 1024, "model": "test", "num_layers": 30}


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_prefix_events")


def _step(reqs, preempted=(), swapped=(), hits=0):
    return {"reqs": [{"id": i, "prefill": p, "decode": d, "context": c} for i, p, d, c in reqs],
            "preempted": list(preempted), "swapped": list(swapped), "cut": [],
            "prefix_hits": hits}


def test_a_hit_is_a_request_admitted_on_cached_tokens(fid):
    """a: admitted cold, preempted, readmitted on 64 cached tokens (one hit); b: admitted on
    32 cached (a hit), its next chunk starts past 0 too (not a lookup); c: swapped out and
    back (its KV kept: no lookup)."""
    steps = [_step([("a", 100, 0, 100), ("b", 50, 0, 82)], hits=32),
             _step([("a", 0, 1, 101), ("b", 40, 0, 122), ("c", 20, 0, 20)],
                   preempted=["a"], swapped=["c"]),
             _step([("a", 37, 0, 101), ("c", 0, 1, 21)], hits=64)]
    assert fid.prefix_hit_events(steps) == (2, 96)
    counts = fid.step_counts(type("T", (), {"steps": steps}))
    assert (counts["prefix_hit_requests"], counts["prefix_hit_tokens"]) == (2, 96)
    assert counts["preemptions"] == 1 and counts["swap_outs"] == 1


def test_the_hits_tokens_are_the_steps_prefix_hits_on_a_simulated_run(fid):
    """On the prefix workload simulated (shared 256-token prefixes), the events' tokens sum to
    what the steps recorded, and there are hits to count (the probe)."""
    w = fid.WORKLOADS["prefix"]
    _, trace = fid.run_sim(w, FittedLatencyModel.from_profile(PROFILE),
                           fid.make_specs(w, 1, False))
    events, tokens = fid.prefix_hit_events(trace.steps)
    assert events >= 10
    assert tokens == sum(s["prefix_hits"] for s in trace.steps) > 0
    assert fid.step_counts(trace)["prefix_hit_requests"] == events


def _row(fid, real: dict, sim: dict) -> dict:
    zero = {k: 0.0 for k in fid.METRICS}
    return {"workload": "slo", "rel_error": zero, "speed_matched": {"rel_error": zero},
            "counts_real": real, "counts_sim": sim}


def test_the_criterion_judges_hit_requests_and_shows_their_tokens(fid):
    """fid7's slo suite: 0.67 real hits a run (225.3 tokens) against 1.08 simulated (354.9):
    within 1 as events, far outside 10% as tokens; the criterion judges the events, the table
    prints both. Two more simulated hits a run is a miss named by its count."""
    base = {"preemptions": 7.5, "swap_outs": 0.0, "cuts": 7.4}
    real = base | {"prefix_hit_requests": 0.67, "prefix_hit_tokens": 225.3}
    sim = base | {"prefix_hit_requests": 1.08, "prefix_hit_tokens": 354.9}
    assert fid.criterion([_row(fid, real, sim)], {}) == []
    table = fid.format_table([_row(fid, real, sim)])
    assert "0.7/1.1" in table and "225.3/354.9" in table
    far = sim | {"prefix_hit_requests": 2.7}
    assert fid.criterion([_row(fid, real, far)], {}) == ["slo prefix_hit_requests real 0.7 vs sim 2.7"]
