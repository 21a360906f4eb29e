"""benchmarks/slo_forced_replay.py: a kept slo run replayed in the simulator on the run's own
clock follows it step for step where the simulator's mechanism is the one that made the run,
and parts where it is not. The "real" run here is the simulator itself on a jittery machine
(each step its own log-normal factor, sigma 8%), written in the real runs' format, so the
mechanism that made it is known to be the simulator's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from fidelity_module import ROOT, SLO_TEST_PROFILE

from tokenweir.sim.latency import FittedLatencyModel, NoisyLatencyModel
from tokenweir.timeline.records import write_jsonl

PROFILE = SLO_TEST_PROFILE


@pytest.fixture(scope="module")
def fr():
    """benchmarks/slo_forced_replay.py as a module (it imports benchmarks.sim_fidelity)."""
    spec = importlib.util.spec_from_file_location(
        "slo_forced_replay_under_test", ROOT / "benchmarks" / "slo_forced_replay.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def kept(fr, tmp_path_factory) -> Path:
    """One slo run (seed 1, quick) of the simulator on a jittery machine, kept as the suite
    keeps a real run: its trace (phases split as the engine traces them, `drained` where it
    idled) and records with the TTFT line it ran with."""
    sf = fr.sf
    w, line = sf.WORKLOADS["slo"], sf.slo_line(PROFILE)
    specs = sf.make_specs(w, 1, True, line)
    machine = NoisyLatencyModel(FittedLatencyModel.from_profile(PROFILE), 0.08, seed=3)
    records, trace = sf.run_sim(w, machine, specs, line)
    overhead = PROFILE["overhead"]["const"]
    steps = trace.steps
    for k, s in enumerate(steps):
        s["phases"] = {"schedule": overhead, "forward": s["duration"] - overhead}
        if k + 1 < len(steps) and steps[k + 1]["start"] > s["start"] + s["duration"] + 1e-9:
            s["drained"] = True
    path = tmp_path_factory.mktemp("kept") / "slo-seed1.jsonl"
    write_jsonl(trace, path)
    sf.records_path(path).write_text(json.dumps(
        {"workload": "slo", "seed": 1, "quick": True, "slo_line": line, "records": records}))
    return path


def num_cuts(steps: list[dict]) -> int:
    return sum(1 for s in steps if s.get("cut"))


def test_the_replay_follows_a_run_of_its_own_mechanism(fr, kept):
    """Every step of the replay is the run's: requests, chunks, cuts, victims, prefix hits,
    and each step starts when the run's did (a cut step ends when the run's cut did, not at
    the replay's own layer of a step the profile times). Probe: the run cut steps (so cuts
    were compared), and its times are not the profile's (the next test: replayed on the
    profile's clock it parts)."""
    result = fr.replay(PROFILE, kept)
    real, sim = result["real"], result["sim"]
    assert num_cuts(real) >= 2
    assert result["first"] is None, fr.format_replay(result)
    assert fr.matched_cuts(result) == num_cuts(real)
    assert [fr.step_key(s) for s in sim] == [fr.step_key(s) for s in real]
    t0 = result["t0"]  # the replay's clock starts at the run's first arrival
    assert [s["start"] for s in sim] == pytest.approx([s["start"] - t0 for s in real], abs=1e-9)


def test_on_the_profiles_clock_it_parts(fr, kept, monkeypatch):
    """The run's own clock is what makes the replay follow: timed by the profile alone (the
    broken variant of TraceClock), the same replay parts from the run."""
    monkeypatch.setattr(fr.TraceClock, "predict_totals",
                        lambda self, totals: self.base.predict_totals(totals))
    assert fr.replay(PROFILE, kept)["first"] is not None


def test_a_monitor_blind_to_arrivals_parts_at_a_cut(fr, kept, monkeypatch):
    """A mechanism error shows as a parting: a modelled monitor that never looks at an
    arrival mid-step (its timer and step-start looks kept) misses a cut the run made, and the
    first step that differs is a cut step of the run."""
    from tokenweir.sim.slo_cuts import SimStepCutter

    monkeypatch.setattr(SimStepCutter, "on_arrival", lambda self, request, now: None)
    result = fr.replay(PROFILE, kept)
    assert result["first"] is not None
    assert result["real"][result["first"]]["cut"]
    assert not result["sim"][result["first"]]["cut"]


def test_cycles_run_to_the_next_start_unless_the_engine_idled(fr):
    steps = [{"start": 0.0, "duration": 0.9}, {"start": 1.0, "duration": 0.5, "drained": True},
             {"start": 4.0, "duration": 0.25}]
    assert fr.trace_cycles(steps) == [1.0, 0.5, 0.25]


def test_the_replay_waits_for_an_engine_that_woke_late(fr, kept, tmp_path):
    """The engine starts a step a little after an arrival that found it idle (2-6 ms at times
    in fid11's runs); the replay starts it when the engine did and keeps the deadline where
    the engine had it. The kept run with the arrival that woke its second busy stretch
    recorded 5 ms earlier (the engine then woke 5 ms late): followed, each step at the run's
    start. Probe: the arrival moved, and without `woken_specs` the replay parts or its steps
    start early."""
    steps = json.loads("[" + ",".join(kept.read_text().splitlines()[1:]) + "]")
    data = json.loads(fr.sf.records_path(kept).read_text())
    wake = next(steps[k]["start"] for k in range(2, len(steps)) if steps[k - 1].get("drained")
                and steps[k]["start"] - steps[k - 1]["start"] - steps[k - 1]["duration"] > 0.05)
    woke = [r for r in data["records"] if r["arrival"] == pytest.approx(wake, abs=1e-9)]
    assert len(woke) == 1
    woke[0]["arrival"] -= 0.005
    late = tmp_path / "slo-seed1.jsonl"
    late.write_text(kept.read_text())
    fr.sf.records_path(late).write_text(json.dumps(data))

    def starts(result):
        return [s["start"] for s in result["sim"]], [s["start"] - result["t0"]
                                                     for s in result["real"]]

    result = fr.replay(PROFILE, late)
    assert result["first"] is None, fr.format_replay(result)
    sim, real = starts(result)
    assert sim == pytest.approx(real, abs=1e-9)
    specs = fr.sf.run_specs("slo", late)
    moved = fr.woken_specs(specs, result["real"], result["t0"])
    assert [m.arrival + m.ttft_slo_ms / 1000 for m in moved] == pytest.approx(
        [s.arrival + s.ttft_slo_ms / 1000 for s in specs], abs=1e-9)
    assert [m.request_id for m, s in zip(moved, specs) if m.arrival != s.arrival] \
        == [woke[0]["request_id"]]


def test_woken_specs_moves_only_arrivals_that_found_the_engine_idle(fr):
    from tokenweir.sim.workload import RequestSpec

    steps = [{"start": 10.001, "duration": 0.5, "drained": True},
             {"start": 12.004, "duration": 0.5}, {"start": 12.504, "duration": 0.5}]
    specs = [RequestSpec(f"r{i}", a, 8, 2, ttft_slo_ms=100.0)
             for i, a in enumerate((0.0, 2.0, 2.2))]
    moved = fr.woken_specs(specs, steps, 10.0)
    assert [m.arrival for m in moved] == pytest.approx([0.001, 2.004, 2.2])
    assert [m.ttft_slo_ms for m in moved] == pytest.approx([99.0, 96.0, 100.0])
