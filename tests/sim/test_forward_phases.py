"""The slo cut's layer boundaries span the step's forward pass, not the whole step
(sim/forward_phases.py, sim/slo_cuts.py: `boundary_after`), as the real runner's layer hook
runs between schedule/prepare and sample/update/output."""

from __future__ import annotations

import math

import pytest

from tokenweir.sim.build import build_simulation
from tokenweir.sim.forward_phases import ForwardPhases, fit_forward_phases
from tokenweir.sim.latency import FittedLatencyModel
from tokenweir.sim.slo_cuts import boundary_after
from tokenweir.sim.workload import RequestSpec
from tokenweir.timeline.records import Trace

L = 30
PHASES = {"pre_s": 0.1, "sample_const_s": 1.0, "sample_per_row_s": 0.25, "post_s": 0.5}
PROFILE = {"coefficients": {"const": 0.02, "prefill_tokens": 0.0015}, "num_layers": L,
           "kv_bytes_per_token": 46080, "max_model_len": 8192}
KW = dict(max_num_batched_tokens=4096, num_gpu_blocks_override=2000, max_model_len=8192,
          scheduling_policy="slo")


def test_boundary_k_falls_at_the_forwards_k_over_l():
    pre, forward, post = 0.1, 4.2, 1.7
    for k in range(1, L):
        at = pre + k / L * forward
        assert boundary_after(at - 1e-6, (pre, forward, post), L) == k
        assert boundary_after(at + 1e-6, (pre, forward, post), L) == k + 1
    assert boundary_after(0.05, (pre, forward, post), L) == 0  # before the forward
    assert boundary_after(pre + forward + 0.5, (pre, forward, post), L) == L  # after it


def test_without_phases_the_boundaries_spread_over_the_whole_step():
    """The old formula, ceil(elapsed / seconds * L), is the split (0, seconds, 0)."""
    seconds = 6.0
    for elapsed in (0.01, 1.0, 2.0, 3.3, 5.99):
        assert boundary_after(elapsed, (0.0, seconds, 0.0), L) == math.ceil(
            elapsed / seconds * L)


def _cut_run(phases):
    """A 4,000-token prompt (one 6.02-s step, its chunk ends the prompt: one row samples),
    cut by an urgent arrival at 2.0 s."""
    profile = dict(PROFILE, forward_phases=phases) if phases else PROFILE
    specs = [RequestSpec("long", 0.0, 4000, 8, index=0),
             RequestSpec("urgent", 2.0, 200, 8, ttft_slo_ms=1000.0, index=1)]
    sim = build_simulation(dict(KW), specs, latency_model=FittedLatencyModel.from_profile(
        profile), check=True)
    sim.run()
    return sim


def test_a_cut_lands_on_the_forwards_boundary_and_lasts_its_share():
    sim = _cut_run(PHASES)
    assert sim.instance.cutter.phases is not None
    assert sim.scheduler.stats.slo_cut_steps == 1  # the probe: the step was cut
    seconds = 0.02 + 0.0015 * 4000
    pre, post = PHASES["pre_s"], PHASES["post_s"]
    forward = seconds - pre - post - PHASES["sample_const_s"] - PHASES["sample_per_row_s"]
    k = math.ceil((2.0 - pre) / forward * L)  # 13; the whole-step formula gives 10
    assert k != math.ceil(2.0 / seconds * L)
    # cut before layer k: pre-forward work, k layers, the update (no sampling)
    assert sim.steps[0].seconds == pytest.approx(pre + k / L * forward + post)


def test_without_phases_the_cut_is_the_whole_steps_share():
    sim = _cut_run(None)
    assert sim.instance.cutter.phases is None and sim.scheduler.stats.slo_cut_steps == 1
    seconds = 0.02 + 0.0015 * 4000
    k = math.ceil(2.0 / seconds * L)
    assert sim.steps[0].seconds == pytest.approx(k / L * seconds)


def _step(rows, prefill, sample, start, schedule=0.001, prepare=0.0005):
    reqs = [{"id": f"r{i}", "prefill": prefill if i == 0 else 0,
             "decode": 0 if (prefill and i == 0) else 1, "context": 100} for i in range(rows)]
    phases = {"schedule": schedule, "prepare": prepare, "forward": 0.05, "update": 0.0002,
              "output": 0.0003}
    if sample is not None:
        phases["sample"] = sample
    return {"reqs": reqs, "start": start, "duration": 0.06 + (sample or 0.0),
            "phases": phases}


def test_fit_forward_phases_recovers_the_sampling_line():
    steps, t = [], 0.0
    for rows in (1, 2, 3, 5, 8, 1, 4):
        steps.append(_step(rows, 0, 0.009 + 0.0008 * rows, t))
        t += steps[-1]["duration"] + 0.0001  # a 0.1-ms gap before the next step
    steps.append(_step(2, 300, 0.0095, t))  # a prefill step: not in the sampling line
    fit = fit_forward_phases([Trace(steps)])
    assert fit["sample_const_s"] == pytest.approx(0.009)
    assert fit["sample_per_row_s"] == pytest.approx(0.0008)
    assert fit["pre_s"] == pytest.approx(0.0015)
    assert fit["post_s"] == pytest.approx(0.0006)  # update + output + gap (last: no gap)
    assert fit["num_steps"] == len(steps)
    assert fit_forward_phases([Trace([dict(s, phases={"execute": 0.06}) for s in steps])]) \
        is None  # no forward phase: no fit


def test_a_step_too_short_for_the_phases_is_all_forward():
    phases = ForwardPhases(PHASES)
    assert phases.split(0.5, 1) == (0.0, 0.5, 0.0)
    split = phases.split(10.0, 2)
    assert split == pytest.approx((0.1, 10.0 - 0.1 - 0.5 - 1.5, 2.0))
    assert phases.cut_seconds(split, 3, L) == pytest.approx(0.1 + 3 / L * split[1] + 0.5)


def test_calibrate_from_traces_writes_forward_phases_and_the_profile_carries_them(tmp_path):
    from tests.sim.test_calibrate_trace import engine_like_trace
    from tokenweir.sim.calibrate_trace import calibrate_from_traces
    from tokenweir.timeline.records import write_jsonl

    _, trace = engine_like_trace(tmp_path / "plain.jsonl", seed=1)
    plain = calibrate_from_traces([str(tmp_path / "plain.jsonl")], holdout_every=5)
    assert plain["forward_phases"] is None  # no sample phase: nothing to fit
    for s in trace.steps:
        if s.get("phases") and s["reqs"] and all(r["prefill"] == 0 for r in s["reqs"]):
            s["phases"]["sample"] = 0.009 + 0.0008 * len(s["reqs"])
    write_jsonl(trace, tmp_path / "sampled.jsonl")
    profile = calibrate_from_traces([str(tmp_path / "sampled.jsonl")], holdout_every=5)
    fit = profile["forward_phases"]
    assert fit["sample_const_s"] == pytest.approx(0.009)
    assert fit["sample_per_row_s"] == pytest.approx(0.0008)
    assert FittedLatencyModel.from_profile(profile).forward_phases == fit
