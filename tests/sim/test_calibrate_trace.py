"""`tokenweir calibrate --from-trace` (issue 16): fitting the step model and the engine's
overhead to traced steps. The traces here are synthetic: simulator runs of a latency model
with KNOWN coefficients, each step's time split into the runner's part and the overhead."""

from __future__ import annotations

import json

import pytest

from tokenweir.sim.build import build_simulation
from tokenweir.sim.calibrate_trace import GAP_CAP_S, calibrate_from_traces, traced_steps
from tokenweir.sim.latency import (OVERHEAD_FEATURES, FittedLatencyModel, NoisyLatencyModel,
                                  StepTotals)
from tokenweir.sim.workload import synthetic
from tokenweir.timeline.recorder import record_simulation
from tokenweir.timeline.records import Trace, write_jsonl

RUNNER = {"const": 0.004, "prefill_tokens": 1.2e-3, "decode_rows": 2.5e-3,
          "prefill_attention": 2e-8, "decode_context": 1e-6, "prefill_rows": 5e-4,
          "multi_decode": 1e-3}
OVERHEAD = {"const": 3e-4, "requests": 2e-5, "decode_requests": 1e-5}
ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks_override=150,
              max_model_len=2048)


def known_model() -> FittedLatencyModel:
    return FittedLatencyModel(RUNNER, kv_bytes_per_token=46080, max_model_len=2048,
                              overhead=OVERHEAD)


def engine_like_trace(path, seed: int, noise: float = 0.0, rate: float = 1e7,
                      model: FittedLatencyModel = None):
    """A simulated run written as a real engine's trace: all requests arrive at once (steps
    back to back; or Poisson at `rate` per second), each step's phases = the runner's known
    share + the overhead (`model`'s; default `known_model()`)."""
    model = model or known_model()
    specs = synthetic(120, rate, seed=seed, prompt="lognormal:200:0.7", output="uniform:2:80",
                      num_prefix_groups=3, prefix_len=64, max_model_len=2048)
    timing = NoisyLatencyModel(model, noise, seed=seed) if noise else model
    sim = build_simulation(ENGINE, specs, latency_model=timing)
    result, trace = record_simulation(sim)
    for s in trace.steps:
        totals = StepTotals.of_chunks((e["prefill"] + e["decode"],
                                       e["context"] - e["prefill"] - e["decode"])
                                      for e in s["reqs"])
        overhead = model.overhead_seconds(totals)
        s["phases"] = {"schedule": overhead / 2, "forward": s["duration"] - overhead,
                       "update": overhead / 2}
    trace.meta.update(model="synthetic", dtype="float32", device="cpu", threads=1,
                      block_size=16, kv_bytes_per_token=46080, max_model_len=2048,
                      num_layers=30, max_num_batched_tokens=256)
    write_jsonl(trace, path)
    return result, trace


def test_from_trace_recovers_known_coefficients(tmp_path):
    result, trace = engine_like_trace(tmp_path / "t.jsonl", seed=1)
    assert result.stats.num_preemptions > 0  # a busy, cramped run: varied step shapes
    profile = calibrate_from_traces([str(tmp_path / "t.jsonl")], holdout_every=5)
    assert profile["num_steps"] == len(traced_steps(trace)) > 100
    assert profile["num_layers"] == 30  # from the trace's meta: where the sim's cuts fall
    assert FittedLatencyModel.from_profile(profile).num_layers == 30
    for name, value in RUNNER.items():
        assert profile["coefficients"][name] == pytest.approx(value, rel=1e-5), name
    for name, value in OVERHEAD.items():
        assert profile["overhead"][name] == pytest.approx(value, rel=1e-4, abs=1e-9), name
    held = profile["heldout"]
    assert held["num_steps"] == profile["num_steps"] // 5
    assert held["mean_rel_error"] < 1e-6 and abs(held["total_rel_error"]) < 1e-6
    model = FittedLatencyModel.from_profile(profile)
    assert model.step_time([(100, 50), (1, 300)]) == \
        pytest.approx(known_model().step_time([(100, 50), (1, 300)]), rel=1e-6)


def test_from_trace_validates_on_another_seed_with_noise(tmp_path):
    """Step times with 5% log-normal jitter: the fit on one seed predicts the held-out steps
    of another seed's run within a few percent in sum (per step, about the jitter)."""
    engine_like_trace(tmp_path / "a.jsonl", seed=2, noise=0.05)
    _, other = engine_like_trace(tmp_path / "b.jsonl", seed=3, noise=0.05)
    profile = calibrate_from_traces([str(tmp_path / "a.jsonl")], holdout_every=4)
    assert 0.0 < profile["heldout"]["mean_rel_error"] < 0.08
    model = FittedLatencyModel.from_profile(profile)
    steps = traced_steps(other)
    predicted = sum(model.predict_totals(s.totals) for s in steps)
    assert predicted / sum(s.cycle for s in steps) == pytest.approx(1.0, abs=0.02)


def _step(start: float, duration: float, **queues) -> dict:
    return {"start": start, "duration": duration, "reqs": [{"prefill": 0, "decode": 1,
            "context": 100}], "phases": {"forward": duration / 2}, **queues}


def test_an_idle_gap_is_not_folded_into_the_step_before_it():
    """Issue 36: a gap after which the engine had work is its loop's own cost (in the cycle,
    up to GAP_CAP_S); a gap after a step that left it drained is idling for arrivals, which
    the simulator models itself: not in the cycle. Both the new key (`drained`) and a trace
    written before it (queues read after the update: both empty) say so."""
    gap = 0.0015
    assert gap < GAP_CAP_S  # the probe: the old rule would have folded all of it in
    busy = Trace([_step(0.0, 0.01, running=2, waiting=1), _step(0.0115, 0.01, running=2)],
                 {}, {})
    drained = Trace([_step(0.0, 0.01, running=2, drained=True), _step(0.0115, 0.01)], {}, {})
    old_drained = Trace([_step(0.0, 0.01, running=0, waiting=0), _step(0.0115, 0.01)], {}, {})
    assert traced_steps(busy)[0].cycle == pytest.approx(0.01 + gap)
    assert traced_steps(drained)[0].cycle == pytest.approx(0.01)
    assert traced_steps(old_drained)[0].cycle == pytest.approx(0.01)
    long_gap = Trace([_step(0.0, 0.01, running=1), _step(0.02, 0.01)], {}, {})
    assert traced_steps(long_gap)[0].cycle == pytest.approx(0.01 + GAP_CAP_S)


def test_profiles_without_overhead_load_and_predict_as_before():
    old = {"format": "tokenweir-step-profile/1", "coefficients": RUNNER}
    model = FittedLatencyModel.from_profile(old)
    assert set(model.overhead) == set(OVERHEAD_FEATURES) and not any(model.overhead.values())
    totals = StepTotals.of_chunks([(64, 0), (1, 100), (1, 30)])
    assert model.predict_totals(totals) == model.runner_seconds(totals)
    with_overhead = FittedLatencyModel.from_profile({**old, "overhead": OVERHEAD})
    assert with_overhead.predict_totals(totals) == pytest.approx(
        model.predict_totals(totals) + 3e-4 + 3 * 2e-5 + 2 * 1e-5)
    with pytest.raises(ValueError, match="engine-overhead"):
        FittedLatencyModel(RUNNER, overhead={"per_token": 1.0})


def test_calibrate_cli_from_trace(tmp_path, capsys):
    from tokenweir.cli import main

    engine_like_trace(tmp_path / "t.jsonl", seed=4, noise=0.03)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-trace", str(tmp_path / "t.jsonl"), "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out steps" in printed and "engine overhead per step" in printed
    profile = json.loads(out.read_text())
    assert profile["source"] == "trace" and profile["heldout"]["num_steps"] > 0
    from tokenweir.sim.calibrate import load_profile
    assert load_profile(str(out))["overhead"]["const"] > 0
    # The TTFT predictor is quadratic (attention makes the solo-TTFT curve convex), and the
    # engine's slo policy reads all three terms from the profile.
    ttft = profile["ttft"]
    assert ttft["b"] > 0 and ttft["r2"] > 0.99
    assert "warning" not in ttft and "warning" not in capsys.readouterr().err
    from tokenweir.config import SchedulerConfig
    from tokenweir.engine.slo_monitor import resolve_ttft_predictor
    from tokenweir.sim.slo_cuts import solo_ttft

    predictor = resolve_ttft_predictor(SchedulerConfig(slo_ttft_profile=str(out)),
                                       lambda: (0.0, 0.0))
    assert (predictor.a, predictor.b, predictor.c) == (ttft["a"], ttft["b"], ttft["c"])
    model = FittedLatencyModel.from_profile(profile)
    for n in (200, 1000, 2000):
        assert predictor.predict(n) == pytest.approx(solo_ttft(model, n, 256), rel=0.05)


def test_calibrate_warns_on_a_ttft_line_that_predicts_negative_times(tmp_path, capsys,
                                                                    monkeypatch):
    """The issue's fit: a -8,057 ms intercept, said nothing. Now a warning on stderr, in the
    report and in the profile (the step model is still written: it may be sound)."""
    from tokenweir.cli import main
    from tokenweir.sim import calibrate_trace

    engine_like_trace(tmp_path / "t.jsonl", seed=4, noise=0.03)
    fit = calibrate_trace.calibrate_from_traces

    def fit_with_the_issues_line(paths, holdout_every, **kwargs):
        profile = fit(paths, holdout_every, **kwargs)
        profile["ttft"].update(a=3e-3, b=0.0, c=-8.057)
        return profile
    monkeypatch.setattr(calibrate_trace, "calibrate_from_traces", fit_with_the_issues_line)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-trace", str(tmp_path / "t.jsonl"), "--out",
                 str(out)]) == 0
    printed = capsys.readouterr()
    assert "warning: the fitted TTFT line predicts -8054.0 ms for a 1-token prompt" in (
        printed.err)
    assert "WARNING: the fitted TTFT line" in printed.out
    assert json.loads(out.read_text())["ttft"]["warning"].startswith("the fitted TTFT line")


@pytest.mark.parametrize("ttft,lowest", [
    ({"a": 1e-3, "b": 1e-7, "c": 0.02}, (1, 0.0210001)),           # rising: its first token
    ({"a": 3e-3, "c": -8.057}, (1, -8.054)),                         # the issue's intercept
    ({"a": -1e-3, "b": 1e-6, "c": 0.1}, (500, -0.15)),               # negative only mid-range
    ({"a": -1e-3, "c": 1.0}, (2048, -1.048)),                        # falling: the longest
])
def test_lowest_ttft_finds_the_minimum_over_every_prompt_length(ttft, lowest):
    from tokenweir.sim.calibrate import lowest_ttft, negative_ttft_warning

    n, seconds = lowest_ttft(ttft, 2048)
    assert n == lowest[0] and seconds == pytest.approx(lowest[1])
    warning = negative_ttft_warning({"ttft": ttft, "max_model_len": 2048})
    assert (warning is None) == (lowest[1] >= 0)


def test_runner_fit_weights_each_step_by_the_square_root_of_its_time(tmp_path, monkeypatch):
    """The weighting: power 1 is the relative-error fit, 0 plain least squares, and the trace
    calibration uses RUNNER_WEIGHT_POWER (0.5). On steps the model cannot fit exactly (a time
    that grows faster than any feature), the weighted fits differ, and the lower the power
    the closer the summed prediction comes to the summed time (long steps weigh more)."""
    import numpy as np

    import tokenweir.sim.calibrate_trace as ct
    from tokenweir.sim.calibrate import fit_step_model

    shapes = [StepTotals.of_chunks([(1, c)] * n) for n in (1, 4, 16, 64) for c in (10, 200)]
    shapes += [StepTotals.of_chunks([(q, 0)]) for q in (32, 256, 1024, 2048)]
    seconds = [0.01 + 1e-4 * t.num_tokens ** 1.3 for t in shapes]  # no feature is t^1.3
    fits = {w: fit_step_model(shapes, seconds, w) for w in (1.0, 0.5, 0.0)}
    totals = {w: sum(f.predicted) / sum(seconds) - 1 for w, f in fits.items()}
    assert abs(totals[0.0]) < abs(totals[0.5]) < abs(totals[1.0])
    plain = fit_step_model(shapes, seconds, 0.0)
    assert fit_step_model(shapes, seconds).coefficients == fits[1.0].coefficients  # default
    assert np.all(np.array(list(plain.coefficients.values())) >= 0)
    from tokenweir.sim.step_fit import fit_within_windows

    used = []
    monkeypatch.setattr("tokenweir.sim.step_fit.fit_within_windows",
                        lambda t, s, k, w=1.0, r=0, lv=None, h=0: used.append((w, r))
                        or fit_within_windows(t, s, k, w, r, lv, h))
    engine_like_trace(tmp_path / "t.jsonl", seed=1)
    calibrate_from_traces([str(tmp_path / "t.jsonl")])
    # probe: the trace fit (within windows since fid6) used the weighting, scaled by
    # predicted times
    assert used and set(used) == {(ct.RUNNER_WEIGHT_POWER, ct.RUNNER_REWEIGHT_ROUNDS)}
    assert ct.RUNNER_WEIGHT_POWER == 0.5 and ct.RUNNER_REWEIGHT_ROUNDS > 0


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_reweighted_fit_is_not_pulled_low_by_stalled_steps(power):
    """Each shape run 10 times, one of them stalled at 2x (a real machine's right-skewed
    jitter): the mean is 1.1x. Residuals scaled by the MEASURED time weigh the stalled run
    less because it stalled, and the fit lands below the mean (probe); scaled by the
    predicted time (reweight_rounds) it lands on the mean of every shape."""
    from tokenweir.sim.calibrate import fit_step_model
    from tokenweir.sim.latency import FittedLatencyModel

    truth = known_model()
    shapes = [StepTotals.of_chunks([(1, c)] * n) for n in (1, 3, 8) for c in (50, 400)]
    shapes += [StepTotals.of_chunks([(q, c)] + [(1, 100)] * n)
               for q in (16, 128, 512) for c in (0, 256) for n in (0, 4)]
    totals = [t for t in shapes for _ in range(10)]
    seconds = [truth.runner_seconds(t) * (2.0 if i % 10 == 0 else 1.0)
               for i, t in enumerate(totals)]
    measured = fit_step_model(totals, seconds, power)
    assert sum(measured.predicted) / sum(seconds) < 0.985
    fit = fit_step_model(totals, seconds, power, reweight_rounds=3)
    assert sum(fit.predicted) / sum(seconds) == pytest.approx(1.0, abs=1e-6)
    model = FittedLatencyModel(fit.coefficients)
    for t in shapes:
        assert model.runner_seconds(t) == pytest.approx(1.1 * truth.runner_seconds(t), rel=1e-6)


# ---- machine drift (issue 16): measured, and divided out of the shape error -------------------
def drifting(steps, factor, after: float, kind: str = "decode"):
    """The steps with the runner time of every `kind` step starting at or after `after`
    seconds (from the first step) multiplied by `factor`: a machine that slows down."""
    import dataclasses

    from tokenweir.sim.calibrate_trace import step_kind

    t0 = steps[0].start
    return [dataclasses.replace(s, runner=s.runner * factor)
            if s.start - t0 >= after and step_kind(s.totals) == kind else s for s in steps]


def test_machine_speed_measures_a_slow_stretch_per_step_kind(tmp_path):
    from tokenweir.sim.calibrate_trace import (MIN_WINDOW_STEPS, machine_speed,
                                               speed_windows, step_kind)

    _, trace = engine_like_trace(tmp_path / "t.jsonl", seed=5)
    steps = traced_steps(trace)
    half = (steps[-1].start - steps[0].start) / 2
    window = half / 3  # three windows per half
    model = known_model()
    assert machine_speed(model, steps, window)["decode"]["ratio"] == pytest.approx(1.0)
    slow = drifting(steps, 1.5, half)
    windows = speed_windows(model, slow, window)
    assert windows["prefill"] == pytest.approx([1.0] * len(windows["prefill"]))
    assert min(windows["decode"]) == pytest.approx(1.0) and \
        max(windows["decode"]) == pytest.approx(1.5)
    speed = machine_speed(model, slow, window)
    assert 1.0 < speed["decode"]["ratio"] < 1.5 and speed["prefill"]["ratio"] == \
        pytest.approx(1.0)
    # A window with fewer than MIN_WINDOW_STEPS steps of a kind gives that kind no ratio.
    decodes = [s for s in slow if step_kind(s.totals) == "decode"][:MIN_WINDOW_STEPS]
    assert len(speed_windows(model, decodes, 1e9)["decode"]) == 1
    assert speed_windows(model, decodes[:-1], 1e9)["decode"] == []


def test_local_ratios_divide_out_drift_but_keep_a_lone_slow_step(tmp_path):
    import dataclasses

    from tokenweir.sim.calibrate_trace import local_ratios, step_kind

    _, trace = engine_like_trace(tmp_path / "t.jsonl", seed=6)
    steps = traced_steps(trace)
    model = known_model()
    # decode steps drift to 1.4x in the second half, prefill steps to 2x: no local error
    slow = drifting(drifting(steps, 1.4, 0.5 * (steps[-1].start - steps[0].start)),
                    2.0, 0.5 * (steps[-1].start - steps[0].start), "prefill")
    assert slow != steps  # the drift happened
    local = local_ratios(model, slow)
    known = [r for r in local if r is not None]
    assert len(known) > 0.9 * len(steps)
    assert sorted(known)[len(known) // 10] > 0.99 and sorted(known)[-len(known) // 10] < 1.01
    # one step 1.3x slower than its neighbours: its local ratio says so
    i = next(i for i, s in enumerate(slow) if step_kind(s.totals) == "decode" and i > 20)
    spiked = slow[:i] + [dataclasses.replace(slow[i], runner=1.3 * slow[i].runner)] + slow[i + 1:]
    assert local_ratios(model, spiked)[i] == pytest.approx(1.3, rel=0.01)
    assert local_ratios(model, slow[:3]) == [None, None, None]  # too few neighbours


def test_from_trace_reports_drift_apart_from_the_model_error(tmp_path):
    """A calibration trace whose machine slows to 1.3x halfway: the fitted model's held-out
    error is large (probe: the drift reached the fit), its error against neighbouring steps
    stays small, and the profile records the drift per trace."""
    from tokenweir.sim.calibrate import format_report

    _, trace = engine_like_trace(tmp_path / "t.jsonl", seed=7)
    t0, t1 = trace.steps[0]["start"], trace.steps[-1]["start"]
    for s in trace.steps:
        if s["start"] - t0 >= (t1 - t0) / 2 and s.get("phases"):
            s["phases"]["forward"] *= 1.3
    write_jsonl(trace, tmp_path / "t.jsonl")
    profile = calibrate_from_traces([str(tmp_path / "t.jsonl")], holdout_every=5)
    held = profile["heldout"]
    assert held["runner_mean_rel_error"] > 0.08
    assert held["local_mean_rel_error"] < 0.02
    (speed,) = profile["machine_speed"]
    assert speed["decode"]["max"] / speed["decode"]["min"] == pytest.approx(1.3, rel=0.05)
    assert "machine speed in t.jsonl: decode" in format_report(profile)


# ---- stalls (issue 16): a descheduled engine is no step shape -----------------------------------
def test_from_trace_leaves_stalls_out_of_the_fit(tmp_path, monkeypatch):
    """Three decode steps stalled to 80x (the process descheduled for a second) and one step
    whose output processing stalled: the fit without them recovers the known coefficients, and
    the profile counts them. Probe: with the filter off, the same trace's fit is far off."""
    import tokenweir.sim.calibrate_trace as ct

    _, trace = engine_like_trace(tmp_path / "t.jsonl", seed=8)
    decodes = [s for s in trace.steps if s.get("phases") and all(
        r["decode"] == 1 and not r["prefill"] for r in s["reqs"])]
    stalled = decodes[10:40:10]
    for s in stalled:
        s["phases"]["forward"] *= 80
        s["duration"] = sum(s["phases"].values())
    other = decodes[55]
    other["phases"]["update"] += 0.3  # an overhead stall: 300 ms in the engine's own work
    other["duration"] = sum(other["phases"].values())
    for later in trace.steps[trace.steps.index(other) + 1:]:
        later["start"] += 0.3
    write_jsonl(trace, tmp_path / "t.jsonl")
    profile = calibrate_from_traces([str(tmp_path / "t.jsonl")], holdout_every=5)
    assert profile["stalls"]["num_steps"] == 4
    assert profile["stalls"]["seconds"] > 80 * 0.004 * 3
    for name, value in RUNNER.items():
        assert profile["coefficients"][name] == pytest.approx(value, rel=1e-3, abs=1e-9), name
    for name, value in OVERHEAD.items():
        assert profile["overhead"][name] == pytest.approx(value, rel=1e-3, abs=1e-9), name
    assert abs(profile["heldout"]["total_rel_error"]) < 1e-3
    monkeypatch.setattr(ct, "STALL_LOCAL_RATIO", float("inf"))
    monkeypatch.setattr(ct, "STALL_OVERHEAD_S", float("inf"))
    unfiltered = calibrate_from_traces([str(tmp_path / "t.jsonl")], holdout_every=5)
    assert unfiltered["stalls"]["num_steps"] == 0
    assert any(abs(unfiltered["coefficients"][n] / v - 1) > 0.1 for n, v in RUNNER.items())


def _add_staircase(path, extra: dict[int, float]) -> list[int]:
    """Adds extra[n] seconds to the runner (forward) of every step of n tokens in the trace at
    `path`; returns the token count of each of its steps."""
    from tokenweir.timeline.records import load_jsonl

    trace = load_jsonl(path)
    counts = []
    for s in trace.steps:
        n = sum(e["prefill"] + e["decode"] for e in s["reqs"])
        counts.append(n)
        if n in extra and s.get("phases"):
            s["phases"]["forward"] += extra[n]
            s["duration"] += extra[n]
    write_jsonl(trace, path)
    return counts


def test_few_rows_table_learns_the_kernels_staircase_across_runs(tmp_path):
    """Two runs whose steps of one row count (a decode batch) take 3 ms more than the linear
    model says (the float32 kernel's second pass at 7 rows, in the real traces): the fit's
    few_rows table finds +3 ms at that count and ~0 at the others, and the held-out error
    falls to the linear truth's (probe: the same fit without the table errs)."""
    import tokenweir.sim.calibrate_trace as ct

    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for seed, path in zip((4, 5), paths):
        engine_like_trace(path, seed=seed)
    seen = [_add_staircase(p, {}) for p in paths]
    common = [n for n in range(1, 17)
              if all(c.count(n) >= ct.FEW_ROWS_MIN_RUN_STEPS for c in seen)
              and sum(c.count(n) for c in seen) >= 3 * ct.FEW_ROWS_MIN_STEPS]
    assert common, "the runs have few-row steps of one count in both"
    step_up = max(common, key=lambda n: sum(c.count(n) for c in seen))
    for p in paths:
        _add_staircase(p, {step_up: 0.003})
    profile = calibrate_from_traces([str(p) for p in paths], holdout_every=5)
    table = {int(n): s for n, s in profile["few_rows"].items()}
    model, truth = FittedLatencyModel.from_profile(profile), known_model()
    for rows in table:  # the table carries the step: each count predicted within 0.2 ms
        totals = StepTotals.of_chunks([(1, 100)] * rows)
        extra = 0.003 if rows == step_up else 0.0
        assert model.runner_seconds(totals) == pytest.approx(
            truth.runner_seconds(totals) + extra, abs=2e-4), rows
    assert table[step_up] > 0.002 and max(table.values()) == table[step_up]
    with_table = profile["heldout"]["runner_mean_rel_error"]
    ct_min = ct.FEW_ROWS_MIN_STEPS
    try:
        ct.FEW_ROWS_MIN_STEPS = 10 ** 9  # no count qualifies: the linear model alone
        without = calibrate_from_traces([str(p) for p in paths], holdout_every=5)
    finally:
        ct.FEW_ROWS_MIN_STEPS = ct_min
    assert without["few_rows"] == {}
    assert with_table < 0.3 * without["heldout"]["runner_mean_rel_error"]


def test_few_rows_table_needs_two_runs(tmp_path):
    """One run gives no table: its drift could not be told from a count's cost (a count that
    only occurs while the machine runs slow)."""
    engine_like_trace(tmp_path / "t.jsonl", seed=4)
    counts = _add_staircase(tmp_path / "t.jsonl", {8: 0.003})
    assert counts.count(8) >= 10  # probe: the staircase is there to be learnt
    assert calibrate_from_traces([str(tmp_path / "t.jsonl")])["few_rows"] == {}


def test_few_rows_in_a_profile():
    """JSON keys are strings; a table entry adds to steps of exactly that many tokens; a count
    beyond FEW_ROWS_MAX is refused; a profile without the table predicts as before."""
    from tokenweir.sim.latency import FEW_ROWS_MAX

    base = {"coefficients": RUNNER}
    model = FittedLatencyModel.from_profile({**base, "few_rows": {"7": 0.002}})
    plain = FittedLatencyModel.from_profile(base)
    for rows, extra in ((7, 0.002), (6, 0.0), (8, 0.0)):
        totals = StepTotals.of_chunks([(1, 50)] * rows)
        assert model.predict_totals(totals) - plain.predict_totals(totals) == \
            pytest.approx(extra, abs=1e-15)
    assert model.step_time([(7, 0)]) == pytest.approx(plain.step_time([(7, 0)]) + 0.002)
    with pytest.raises(ValueError, match="outside"):
        FittedLatencyModel.from_profile({**base, "few_rows": {str(FEW_ROWS_MAX + 1): 0.001}})


def test_few_rows_table_keeps_only_the_staircase_shape():
    """The table less its weighted line: a table on a line is all zeros (the linear model
    keeps level and slope, so the alternating fit settles); a step keeps its shape."""
    from tokenweir.sim.calibrate_trace import _detrended

    line = {n: 0.001 + 0.0005 * n for n in range(1, 9)}
    assert all(abs(v) < 1e-12 for v in _detrended(line, {n: 1 for n in line}).values())
    step = {n: 0.003 if n >= 7 else 0.0 for n in range(1, 9)}
    out = _detrended(step, {n: 1 for n in step})
    assert out[7] - out[6] == pytest.approx(0.003, abs=0.001)  # the jump survives
    assert _detrended({1: 0.002, 2: 0.001}, {1: 5, 2: 5}) == {1: 0.0, 2: 0.0}  # < 3: no shape


# ---- the machine's variability (issue 16): what the simulator's machine draws are drawn from ---
def test_variability_measures_step_jitter_and_run_speed(tmp_path):
    """Four runs with 4% log-normal step jitter, the machine at exp(+-5%) of the model's speed
    (one sign per run and step kind): `variability` recovers both sigmas. Probe: the same
    runs without jitter or speed offsets measure ~0 for both."""
    import dataclasses
    import math

    from tokenweir.sim.calibrate_trace import step_kind, variability

    signs = [(+1, -1), (-1, +1), (+1, +1), (-1, -1)]  # (decode, prefill) per run
    clean, noisy = [], []
    for k, (dec, pre) in enumerate(signs):
        _, plain = engine_like_trace(tmp_path / f"c{k}.jsonl", seed=20 + k)
        _, jittered = engine_like_trace(tmp_path / f"n{k}.jsonl", seed=20 + k, noise=0.04)
        clean.append(traced_steps(plain))
        noisy.append([dataclasses.replace(s, runner=s.runner * math.exp(
            0.05 * (dec if step_kind(s.totals) == "decode" else pre)))
            for s in traced_steps(jittered)])
    model = known_model()
    none = [[False] * len(t) for t in clean]
    quiet = variability(model, clean, none)
    assert quiet["step_sigma"] < 1e-6 and quiet["run_sigma"] < 1e-6
    v = variability(model, noisy, none)
    assert v["num_run_kinds"] == 8 and v["num_steps"] > 0.9 * sum(map(len, noisy))
    # the jitter was drawn on the whole step, overhead included: the runner's share is a bit
    # larger than 4%
    assert 0.035 < v["step_sigma"] < 0.05
    assert v["run_sigma"] == pytest.approx(0.05, abs=0.01)
    # a stalled step counts in neither
    stalled = [[i == 30 for i in range(len(t))] for t in noisy]
    wild = [t[:30] + [dataclasses.replace(t[30], runner=50 * t[30].runner)] + t[31:]
            for t in noisy]
    assert variability(model, wild, stalled)["run_sigma"] == pytest.approx(v["run_sigma"],
                                                                          rel=0.1)
    assert variability(model, wild, none)["run_sigma"] > 2 * v["run_sigma"]  # probe


def test_from_trace_profile_carries_the_variability(tmp_path):
    from tokenweir.sim.calibrate import format_report

    paths = []
    for k in range(2):
        engine_like_trace(tmp_path / f"t{k}.jsonl", seed=30 + k, noise=0.03)
        paths.append(str(tmp_path / f"t{k}.jsonl"))
    profile = calibrate_from_traces(paths, holdout_every=5)
    v = profile["variability"]
    assert 0.02 < v["step_sigma"] < 0.05 and v["num_run_kinds"] == 4
    assert "machine variability (log-space sigma, `variability`): step to step" in \
        format_report(profile)


def test_runner_scale_applies_a_measured_speed_per_step_kind(tmp_path):
    """A profile's "runner_scale" multiplies each kind's runner time (not the overhead): the
    model at the speed machine_speed measured on a slow run measures that run at 1.0x."""
    from tokenweir.sim.calibrate_trace import machine_speed

    _, trace = engine_like_trace(tmp_path / "t.jsonl", seed=7)
    steps = traced_steps(trace)
    slow = drifting(drifting(steps, 1.3, 0.0), 1.1, 0.0, "prefill")
    assert slow != steps  # the slowdown happened
    profile = {"coefficients": RUNNER, "overhead": OVERHEAD}
    speed = machine_speed(FittedLatencyModel.from_profile(profile), slow)
    assert speed["decode"]["ratio"] == pytest.approx(1.3)
    assert speed["prefill"]["ratio"] == pytest.approx(1.1)
    scaled = FittedLatencyModel.from_profile(
        {**profile, "runner_scale": {k: s["ratio"] for k, s in speed.items()}})
    assert scaled.runner_scale == pytest.approx({"decode": 1.3, "prefill": 1.1})
    again = machine_speed(scaled, slow)
    assert {k: s["ratio"] for k, s in again.items()} == pytest.approx(
        {"decode": 1.0, "prefill": 1.0})
    base = known_model()
    decode, mixed = StepTotals.of_chunks([(1, 40), (1, 90)]), StepTotals.of_chunks(
        [(64, 0), (1, 90)])
    for totals, factor in ((decode, 1.3), (mixed, 1.1)):
        assert scaled.predict_totals(totals) == pytest.approx(
            factor * base.runner_seconds(totals) + base.overhead_seconds(totals))
    # no scale, or every factor 1: the same floats as before
    ones = FittedLatencyModel(RUNNER, overhead=OVERHEAD,
                              runner_scale={"decode": 1.0, "prefill": 1.0})
    assert ones.predict_totals(mixed) == base.predict_totals(mixed)
    with pytest.raises(ValueError, match="kinds"):
        FittedLatencyModel(RUNNER, runner_scale={"decodes": 1.2})
    with pytest.raises(ValueError, match="> 0"):
        FittedLatencyModel(RUNNER, runner_scale={"decode": 0})
