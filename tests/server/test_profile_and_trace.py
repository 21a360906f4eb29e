"""One step-observation mechanism (issue 16): the serving profile (--profile-serving) reads the
engine core's step observer hook, as the step tracer (--trace) does, and both observe the same
steps at once. A counting clock (one tick per reading) makes every phase an exact count: a step
reads the clock at its start, after scheduling, after the forward, for the update's `now`, and
at the observer call, so schedule = 1, forward (execute) = 1 and update = 2 ticks per step."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

import pytest

from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.serving_profile import ServingProfile
from tokenweir.timeline.tracer import StepTracer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import fold_scenarios as fs  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return fs.tiny_path(tmp_path_factory.mktemp("tiny-llama-profile-trace"))


def _serve(served: AsyncEngine, scenario: str) -> int:
    """Stream the scenario's requests; the number of tokens streamed."""
    async def one(index, rid, params) -> int:
        return sum([len(c.token_ids) async for out in served.generate(
            {"prompt_token_ids": fs.PROMPTS[index]}, params, request_id=rid)
            for c in out.outputs])

    async def main() -> int:
        served.start()
        try:
            return sum(await asyncio.gather(*(one(*s) for s in fs.SCENARIOS[scenario])))
        finally:
            served.shutdown()

    return asyncio.run(main())


def test_trace_file_and_serving_profile_observe_the_same_steps(tiny_path, tmp_path):
    engine = fs.scripted_engine(tiny_path)
    ticks = itertools.count()
    engine.core.clock = lambda: float(next(ticks))
    trace = tmp_path / "run.jsonl"
    engine.start_trace(str(trace))
    profile = ServingProfile()
    served = AsyncEngine(engine, profile=profile)
    observers = engine.core.step_observers
    assert len(observers) == 2 and isinstance(observers[0], StepTracer)
    tokens = _serve(served, "parallel")
    engine.close()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if "phases" in r]
    snap = profile.snapshot()
    assert snap["steps"] >= len(steps) >= 10, "probe: both saw a run of real steps"
    assert snap["tokens"] == tokens > 0
    seconds = profile.seconds
    assert (seconds["schedule"], seconds["forward"], seconds["update"]) == \
        (snap["steps"], snap["steps"], 2 * snap["steps"])
    assert all(r["phases"] == {"schedule": 1.0, "execute": 1.0, "update": 2.0} for r in steps)
    assert served.engine.outputs.states == {}


def test_a_detached_profile_sees_no_more_steps(tiny_path):
    engine = fs.scripted_engine(tiny_path)
    profile = ServingProfile()
    profile.attach(engine.core)
    engine.add_request(*engine.make_request({"prompt_token_ids": fs.PROMPTS[0]},
                                            fs._p(ignore_eos=True)))
    engine.step()
    seen = profile.seconds["schedule"]
    assert seen > 0, "probe: the attached profile observed a step"
    profile.detach(engine.core)
    while engine.has_unfinished_requests():
        engine.step()
    assert profile.seconds["schedule"] == seen and engine.core.step_observers == []
