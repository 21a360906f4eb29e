"""A simulation run pauses the cyclic collector (sim_engine.gc_paused) and, on resuming, moves
what the run left alive to the oldest generation instead of letting the first allocation
trigger a pass over all of it (a pass that finds nothing: the loop makes no cycles, which
test_sim_fast_paths and test_cluster check with a full collection afterwards)."""

from __future__ import annotations

import gc

import pytest

from tokenweir.sim.build import build_simulation
from tokenweir.sim.sim_engine import gc_paused
from tokenweir.sim.workload import synthetic

from gc_passes import counting_passes  # tests/gc_passes.py


def _passes_during(fn) -> tuple[list[int], object]:
    """The generations of the collector's passes from `fn()`'s start to its return."""
    with counting_passes() as passes:
        result = fn()
        seen = list(passes)
    return seen, result


@pytest.fixture
def nothing_frozen():
    """A process without frozen objects, as a simulation's own process is: in the suite an
    earlier test of this worker may have started an engine, whose startup_gc froze its objects
    (then gc_paused leaves the collector as it finds it). Thawed for the test, frozen again
    after (everything alive then, a superset: the collector only skips more)."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


def test_a_run_resumes_the_collector_without_a_pass_over_what_it_made(nothing_frozen):
    specs = synthetic(300, 200.0, seed=1, prompt="lognormal:90:0.7", output="lognormal:40:0.9",
                      max_model_len=1024)
    sim = build_simulation({"max_model_len": 1024}, specs, "smollm2-135m", "h100")
    gc.collect()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    passes, result = _passes_during(sim.run)
    assert passes == []
    assert gc.isenabled() and gc.get_freeze_count() == 0  # resumed, nothing left frozen
    assert gc.get_count()[0] < 700  # probe: the run's objects left the young generation
    assert len(result.requests) == 300 and gc.collect() == 0


def test_resuming_still_collects_cycles_made_while_paused():
    """What the move put in the oldest generation is still examined: a cycle made while
    paused is found by the next full collection."""
    gc.collect()
    with gc_paused():
        cycle: list = []
        cycle.append(cycle)
        del cycle
    assert gc.isenabled()
    assert gc.collect() >= 1


def test_a_process_with_frozen_objects_keeps_them_frozen():
    """A caller's frozen objects (startup_gc freezes the engine's) stay frozen: no move."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            pass
        assert gc.get_freeze_count() == frozen > 0 and gc.isenabled()
    finally:
        gc.unfreeze()
