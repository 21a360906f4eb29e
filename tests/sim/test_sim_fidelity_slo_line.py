"""benchmarks/sim_fidelity.py's slo workload: its TTFT line (deadlines and the slo policy's
predictor) comes from the calibrated profile, is fixed once per kept suite, recorded with each
real run, and read back by the replay, so the engine and the simulator see the same deadlines."""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest
from fidelity_module import SLO_TEST_PROFILE, loaded_sim_fidelity  # tests/sim/fidelity_module.py

PROFILE = SLO_TEST_PROFILE


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_slo_line")


def deadlines(fid, line: dict, seed: int = 1) -> list[float]:
    return [s.ttft_slo_ms for s in fid.make_specs(fid.WORKLOADS["slo"], seed, True, line)]


def test_the_slo_line_scales_with_the_profile(fid):
    """A machine twice as slow (every step time x2) gets a line twice as steep with twice the
    intercept, and every deadline doubles. Probe: the two profiles' solo TTFTs do differ 2x,
    and each line is the profile's own solo TTFT (within 3%) over the workload's prompts."""
    from tokenweir.sim.latency import FittedLatencyModel
    from tokenweir.sim.slo_cuts import solo_ttft

    slow = fid.scaled_profile(PROFILE, 2.0)
    fast_line, slow_line = fid.slo_line(PROFILE), fid.slo_line(slow)
    assert slow_line == pytest.approx({k: 2 * v for k, v in fast_line.items()}, rel=1e-6)
    assert deadlines(fid, slow_line) == pytest.approx([2 * d for d in deadlines(fid, fast_line)],
                                                      rel=1e-6)
    for profile, line in ((PROFILE, fast_line), (slow, slow_line)):
        model = FittedLatencyModel.from_profile(profile)
        for n in (64, 300, 600):
            solo_ms = 1000 * solo_ttft(model, n, fid.SLO_BUDGET)
            assert fid.ttft_line_ms(line, n) == pytest.approx(solo_ms, rel=0.03)
    slow_model = FittedLatencyModel.from_profile(slow)
    fast_model = FittedLatencyModel.from_profile(PROFILE)
    assert solo_ttft(slow_model, 300, 512) == pytest.approx(2 * solo_ttft(fast_model, 300, 512))


def test_the_slo_workload_needs_a_line(fid):
    """No silent default line (the fixed 1.6 ms/token was 2.5x too fast on fid4's machine)."""
    with pytest.raises(ValueError, match="TTFT line"):
        fid.make_specs(fid.WORKLOADS["slo"], 1, True)
    with pytest.raises(ValueError, match="TTFT line"):
        fid.engine_kwargs(fid.WORKLOADS["slo"], None)
    assert fid.make_specs(fid.WORKLOADS["light"], 1, True)  # no deadlines, no line needed


def test_one_line_per_suite(fid, tmp_path):
    """The suite's first slo run fixes the line in the trace dir; a later collection, even
    with another --slo-profile, reads it. Probe: the second profile gives another line. No
    profile and no calibration runs kept: refused."""
    first, other = tmp_path / "p1.json", tmp_path / "p2.json"
    first.write_text(json.dumps(PROFILE))
    other.write_text(json.dumps(fid.scaled_profile(PROFILE, 1.5)))
    args = argparse.Namespace(seed=0, calibration_runs=2, validation_seeds=3,
                              slo_profile=str(first))
    line = fid.suite_slo_line(args, tmp_path)
    assert line == pytest.approx(fid.slo_line(PROFILE))
    args.slo_profile = str(other)
    assert fid.slo_line(fid.scaled_profile(PROFILE, 1.5))["a"] > 1.4 * line["a"]
    assert fid.suite_slo_line(args, tmp_path) == line
    args.slo_profile = None
    with pytest.raises(SystemExit, match="needs a profile"):
        fid.suite_slo_line(args, tmp_path / "empty")


class _FakeEngine:
    """Just enough of LLMEngine for run_engine: each request finishes at its first step; it
    keeps the config it was built with and every request's deadline."""
    built: list = []

    def __init__(self, config, loaded=None):
        self.config, self.requests, self.pending = config, [], []
        _FakeEngine.built.append(self)

    def make_request(self, prompt, params, request_id, priority=0, ttft_slo_ms=None):
        r = types.SimpleNamespace(request_id=request_id, ttft_slo_ms=ttft_slo_ms,
                                  arrival_time=float(len(self.requests)), first_token_time=None,
                                  finished_time=None, num_output_tokens=params.max_tokens)
        return r, None

    def add_request(self, request, text):
        self.pending.append(request)

    def submit_request(self, request, text):
        self.requests.append(request)
        self.pending.append(request)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        for r in done:
            r.first_token_time, r.finished_time = r.arrival_time + 0.5, r.arrival_time + 1.0
        return [types.SimpleNamespace(finished=True) for _ in done]

    def start_trace(self, path):
        Path(path).write_text("")

    def shutdown(self):
        pass


def test_the_engine_and_the_replay_see_the_same_deadlines(fid, tmp_path, monkeypatch):
    """A real slo run (a fake engine) with the suite's line: the engine is configured with
    that line as its predictor and gets each request's deadline from it; the replay reads the
    line from the run's records, so the simulation's requests carry the same deadlines and
    its slo policy predicts by the same line. Probe: the line is neither the legacy one nor
    what the replay's own profile would give (a replay that recomputed it would differ)."""
    from tokenweir.engine import llm_engine
    from tokenweir.timeline import recorder

    line = fid.slo_line(fid.scaled_profile(PROFILE, 1.7))
    assert line != fid.slo_line(PROFILE) and line["a"] != fid.LEGACY_SLO_LINE["a"]
    _FakeEngine.built = []
    monkeypatch.setattr(llm_engine, "LLMEngine", _FakeEngine)
    monkeypatch.setattr(fid, "time", types.SimpleNamespace(  # arrivals without the waits
        perf_counter=fid.time.perf_counter, sleep=lambda s: None,
        monotonic=iter(range(0, 10**9, 1000)).__next__))
    args = argparse.Namespace(quick=True, model="smollm2-135m", seed=0)
    loaded = types.SimpleNamespace(arch=types.SimpleNamespace(vocab_size=49152))
    trace = tmp_path / "slo-seed1.jsonl"
    fid.run_engine(args, loaded, "slo", 1, trace, line)
    (engine,) = _FakeEngine.built
    sched = engine.config.scheduler
    assert (sched.slo_ttft_a_ms_per_token, sched.slo_ttft_b_us_per_token2,
            sched.slo_ttft_c_ms) == pytest.approx((1000 * line["a"], 1e6 * line["b"],
                                                   1000 * line["c"]))
    engine_deadlines = {r.request_id: r.ttft_slo_ms for r in engine.requests}
    assert fid.run_line("slo", trace) == line
    replayed = {s.request_id: s.ttft_slo_ms for s in fid.run_specs("slo", trace)}
    assert replayed == engine_deadlines and len(replayed) == 30
    assert sorted(engine_deadlines.values()) == sorted(deadlines(fid, line))

    built = []
    real_record = recorder.record_simulation
    monkeypatch.setattr(recorder, "record_simulation",
                        lambda sim: built.append(sim) or real_record(sim))
    fid.simulate_run("slo", PROFILE, trace)  # the replay, at another profile's speed
    predictor = built[0].scheduler.policy.ttft_predictor
    assert (predictor.a, predictor.b, predictor.c) == pytest.approx(
        (line["a"], line["b"], line["c"]))


def test_a_run_kept_before_lines_were_recorded_replays_with_the_fixed_line(fid, tmp_path):
    """Suites kept before fid5 recorded no line: they ran with 1.6 ms/token + 30 ms."""
    trace = tmp_path / "slo-seed1.jsonl"
    fid.records_path(trace).write_text(json.dumps({"workload": "slo", "seed": 1, "quick": True,
                                                   "records": []}))
    assert fid.run_line("slo", trace) == fid.LEGACY_SLO_LINE
    specs = fid.make_specs(fid.WORKLOADS["slo"], 1, True, fid.LEGACY_SLO_LINE)
    assert [s.ttft_slo_ms for s in specs] == pytest.approx(  # the old formula
        [(1.3 if s.priority == 0 else 6.0) * (1.6 * s.prompt_len + 30) for s in specs])
    assert {s.priority for s in specs} == {0, 1}
    assert fid.run_line("light", trace) is None


def test_skip_kept_runs_only_the_missing_runs(fid, tmp_path, monkeypatch):
    """--skip-kept: a run whose records are kept is not run again (a third repeat added to a
    kept suite). Probe: without it every run is asked for."""
    from tokenweir.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: None)
    ran = []
    monkeypatch.setattr(fid, "run_engine",
                        lambda args, loaded, name, seed, path, line=None: ran.append(path.name) or 1.0)
    monkeypatch.setattr(fid, "stalled_steps", lambda path: [])
    monkeypatch.setattr(fid, "wait_for_quiet", lambda threads: 0.0)
    for seed in (1, 2):
        fid.records_path(fid.real_path(tmp_path, "light", seed)).write_text("{}")
    args = argparse.Namespace(seed=0, repeats=2, noise_floor=False, order="workload",
                              calibration_runs=1, validation_seeds=2, threads=1, retries=0,
                              model="m", skip_kept=True)
    fid.run_real(args, ["light"], tmp_path, calibrate=False)
    assert ran == ["light-seed1-repeat.jsonl", "light-seed2-repeat.jsonl"]
    ran.clear()
    args.skip_kept = False
    fid.run_real(args, ["light"], tmp_path, calibrate=False)
    assert len(ran) == 4


def test_the_slo_load_follows_the_machine(fid):
    """On the machine the workload was designed on (LEGACY_SLO_LINE) it arrives at its 1.5/s;
    on one twice as slow the same prompts arrive half as fast (arrivals stretched 2x), so its
    load stays what it was designed as. Probe: the prompts are the same ones."""
    w = fid.WORKLOADS["slo"]
    assert fid.slo_rate(w, fid.LEGACY_SLO_LINE) == pytest.approx(w.rate)
    slow = {k: 2 * v for k, v in fid.LEGACY_SLO_LINE.items()}
    assert fid.slo_rate(w, slow) == pytest.approx(w.rate / 2)
    base, stretched = (fid.make_specs(w, 1, True, line) for line in (fid.LEGACY_SLO_LINE, slow))
    assert [s.prompt_len for s in stretched] == [s.prompt_len for s in base]
    assert [s.arrival for s in stretched] == pytest.approx([2 * s.arrival for s in base])
    assert max(s.arrival for s in base) > 1.0


def test_max_runs_collects_a_suite_in_holds(fid, tmp_path, monkeypatch):
    """--max-runs N with --skip-kept: each invocation runs the next N missing runs."""
    from tokenweir.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: None)
    ran = []

    def fake_run(args, loaded, name, seed, path, line=None):
        ran.append(path.name)
        fid.records_path(path).write_text("{}")
        return 1.0

    monkeypatch.setattr(fid, "run_engine", fake_run)
    monkeypatch.setattr(fid, "stalled_steps", lambda path: [])
    monkeypatch.setattr(fid, "wait_for_quiet", lambda threads: 0.0)
    args = argparse.Namespace(seed=0, repeats=2, noise_floor=False, order="workload",
                              calibration_runs=1, validation_seeds=2, threads=1, retries=0,
                              model="m", skip_kept=True, max_runs=2)
    holds = []
    for _ in range(3):
        fid.run_real(args, ["light"], tmp_path, calibrate=True)
        holds.append(list(ran))
        ran.clear()
    assert holds == [["light-seed0.jsonl", "light-seed1.jsonl"],
                     ["light-seed2.jsonl", "light-seed1-repeat.jsonl"],
                     ["light-seed2-repeat.jsonl"]]
