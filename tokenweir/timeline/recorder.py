"""Step records from the scheduler itself: `StepRecorder` turns a planned step (the
SchedulerOutput, read right after `schedule()` and before `update_from_output`) into a step
record; `record_simulation` attaches one to a simulator run. The real engine records its steps with
tracer.py's StepTracer (EngineCore's step observer); nothing here imports torch."""

from __future__ import annotations

from typing import Any, Optional

from tokenweir.core.outputs import SchedulerOutput
from tokenweir.timeline.records import Trace


class StepRecorder:
    """Builds step records from one scheduler and its KV cache manager."""

    def __init__(self, scheduler, kv) -> None:
        self.scheduler, self.kv = scheduler, kv
        self._hits_before = kv.prefix_stats.hits
        self.num_steps = 0

    def record(self, start: float, duration: float, out: SchedulerOutput) -> dict[str, Any]:
        """The record of the step planned as `out` (call before update_from_output: the
        requests' computed counts must still be those before the step)."""
        requests, kv = self.scheduler.requests, self.kv
        reqs = []
        for rid, n in out.num_scheduled_tokens.items():
            r = requests[rid]
            before = r.num_computed_tokens
            decode = 1 if r.num_output_tokens > 0 and before + n == r.num_tokens else 0
            reqs.append({"id": rid, "prefill": n - decode, "decode": decode,
                         "context": before + n})
        swapped = sorted(getattr(kv, "req_to_host_blocks", {}))
        hits = kv.prefix_stats.hits
        record = {
            "step": self.num_steps, "start": start, "duration": duration, "reqs": reqs,
            "preempted": sorted(set(out.preempted_req_ids) - set(swapped)),
            "swapped": swapped, "cut": [],
            "paused": [r.request_id for r in self.scheduler.running
                       if r.request_id not in out.num_scheduled_tokens],
            "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
            "kv_usage": round(kv.usage(), 5), "prefix_hits": hits - self._hits_before}
        self._hits_before = hits
        self.num_steps += 1
        return record


def request_record(rec) -> dict[str, Any]:
    """A request line from the simulator's RequestRecord."""
    return {"id": rec.request_id, "arrival": rec.arrival,
            "first_scheduled": rec.first_scheduled, "first_token": rec.first_token,
            "finished": rec.finished, "ttft_slo_ms": rec.ttft_slo_ms,
            "prompt_len": rec.prompt_len, "output_len": rec.num_output,
            "preemptions": rec.num_preemptions, "priority": rec.priority}


def record_simulation(simulation, label: Optional[str] = None) -> tuple[Any, Trace]:
    """Run a single-instance `tokenweir.sim.simulator.Simulation` with a StepRecorder hooked
    into its engine; returns (SimResult, Trace). A step cut mid-way by the slo policy gets the
    victim in `cut` and its shortened duration."""
    engine = simulation.engine
    recorder = StepRecorder(engine.scheduler, engine.kv)
    steps: list[dict] = []
    record_step, complete_step = engine.record_step, engine.complete_step

    def recording_step(now: float, seconds: float, out: SchedulerOutput) -> None:
        steps.append(recorder.record(now, seconds, out))
        record_step(now, seconds, out)

    def recording_complete(out, runner_out, now):
        if runner_out.cut is not None and steps:
            steps[-1]["cut"] = [runner_out.cut.victim_id]
            steps[-1]["duration"] = runner_out.step_seconds
        return complete_step(out, runner_out, now)

    engine.record_step, engine.complete_step = recording_step, recording_complete
    # every step through the hooks above: no decode stretch (it plans without an output)
    stretch, engine.stretch = engine.stretch, None
    try:
        result = simulation.run()
    finally:
        del engine.record_step, engine.complete_step  # back to the class's methods
        engine.stretch = stretch
    requests = {r.request_id: request_record(r) for r in result.requests}
    meta = {"source": "simulator", "label": label or
            f"simulator ({simulation.config.scheduler.scheduling_policy})"}
    return result, Trace(steps, requests, meta)
