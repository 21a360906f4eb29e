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
