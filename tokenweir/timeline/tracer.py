"""Step records from the real engine: `StepTracer` is one of EngineCore's `step_observers`.

EngineCore calls it once per step that ran, after the scheduler's update, with the
SchedulerOutput, the ModelRunnerOutput, the step's EngineCoreOutputs and four clock readings
(started, scheduled, executed, updated). It builds the step record of records.py with a
`phases` dict (seconds): `schedule`, the runner's own split (`prepare`, `forward`, `sample`;
`execute` when the runner does not split), `update`, and `output` (output processing and
detokenization in LLMEngine, reported through `output_processed`). The record is handed to
its sinks once its output time is known (or at the next step, or at `close`).

Sinks: anything with `add_step(record)` and `add_request(record)`; a request record is handed
over when the request is first scheduled and again when it finishes (the same dict, updated),
so a sink keeps the last one per id. `StepRing` (a live server's /timeline) and `JsonlSink`
(`--trace FILE`, plus a Chrome/Perfetto form written at close) are the two kinds.

`running`, `waiting`, `kv_usage` and `paused` are read at the moment the simulator's
StepRecorder reads them: right after `schedule()`, before the step runs (the tracer's
`step_scheduled`, one of EngineCore's `schedule_listeners`; `attach_tracer` hooks both).
`drained` (true or absent) says that after the step's update the engine had no request left,
so the gap to the next step's start is the engine idling for arrivals, not its own loop's
cost (calibrate_trace.traced_steps reads it). Steps that schedule nothing and are not cut are
not recorded. Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput

RUNNER_PHASES = ("prepare", "forward", "sample", "execute")


class StepSink(Protocol):
    def add_step(self, record: dict) -> None: ...

    def add_request(self, record: dict) -> None: ...


class StepTracer:
    """The step observer of one EngineCore (see the module doc)."""

    def __init__(self, scheduler, sinks: list[StepSink],
                 has_work: Optional[Callable[[], bool]] = None) -> None:
        """`has_work`: whether the engine has requests left (default: the scheduler's; an
        EngineCore's also counts its inbox)."""
        self.scheduler, self.kv = scheduler, scheduler.kv
        self.sinks = list(sinks)
        self.has_work = has_work or scheduler.has_unfinished_requests
        # Queue lengths, pool usage and running ids as the last schedule() left them
        # (`step_scheduled`); None when no listener call came (then read after the update).
        self._planned: Optional[tuple[int, int, float, list[str]]] = None
        self.num_steps = 0
        self._hits_before = self.kv.prefix_stats.hits
        self._pending: Optional[dict] = None  # the last step's record, output time not known
        self._open: dict[str, tuple[dict, Any]] = {}  # request id -> (record, Request)

    # ---- the observer --------------------------------------------------------------------
    def step_scheduled(self) -> None:
        """EngineCore's schedule listener: read the queues and the pool as planned."""
        scheduler = self.scheduler
        self._planned = (scheduler.num_running, scheduler.num_waiting, self.kv.usage(),
                         [r.request_id for r in scheduler.running])

    def __call__(self, out: SchedulerOutput, runner_out: ModelRunnerOutput, outputs: list,
                 times: tuple[float, float, float, float]) -> None:
        self.flush()
        self._close_finished(out.finished_req_ids)
        if out.is_empty and runner_out.cut is None:
            return
        started, scheduled, executed, updated = times
        record = self._composition(out, runner_out, outputs)
        if not self.has_work():
            record["drained"] = True
        record.update(step=self.num_steps, start=started, duration=updated - started,
                      phases={"schedule": scheduled - started,
                              **runner_phases(runner_out, executed - scheduled),
                              "update": updated - executed})
        self.num_steps += 1
        self._note_new(out, started, outputs)
        self._note_outputs(outputs)
        self._pending = record

    def output_processed(self, now: float) -> None:
        """The engine finished processing the last step's outputs at `now` (engine clock)."""
        record = self._pending
        if record is not None:
            end = record["start"] + record["duration"]
            record["phases"]["output"] = max(0.0, now - end)
            record["duration"] = max(record["duration"], now - record["start"])
            self.flush()

    def flush(self) -> None:
        record, self._pending = self._pending, None
        if record is not None:
            for sink in self.sinks:
                sink.add_step(record)

    def close(self) -> None:
        """Hand over the last step and every request still open (as they stand)."""
        self.flush()
        self._close_finished(list(self._open))
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()

    # ---- step records --------------------------------------------------------------------
    def _composition(self, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                     outputs: list) -> dict[str, Any]:
        """What ran: per request prefill and decode tokens and context, read after the
        update (a request's token counts less what this step sampled are those before it)."""
        lookup = self.scheduler.requests
        finished_now = {o.request.request_id: o.request for o in outputs}
        sampled = runner_out.sampled_token_ids
        before = computed_before(out)
        reqs = []
        for rid, n in out.num_scheduled_tokens.items():
            request = lookup.get(rid) or finished_now.get(rid)
            start = before.get(rid, 0)
            decode = 0
            if request is not None:
                k = len(sampled.get(rid, ()))
                if request.num_output_tokens - k > 0 and start + n == request.num_tokens - k:
                    decode = 1
            reqs.append({"id": rid, "prefill": n - decode, "decode": decode,
                         "context": start + n})
        swapped = sorted(getattr(self.kv, "req_to_host_blocks", {}))
        hits = self.kv.prefix_stats.hits
        running, waiting, usage, running_ids = self._planned_state()
        record = {"reqs": reqs, "preempted": sorted(set(out.preempted_req_ids) - set(swapped)),
                  "swapped": swapped,
                  "cut": [runner_out.cut.victim_id] if runner_out.cut is not None
                  and runner_out.cut.victim_id else [],
                  "paused": [rid for rid in running_ids
                             if rid not in out.num_scheduled_tokens],
                  "running": running, "waiting": waiting,
                  "kv_usage": round(usage, 5), "prefix_hits": hits - self._hits_before}
        self._hits_before = hits
        return record

    def _planned_state(self) -> tuple[int, int, float, list[str]]:
        """(running, waiting, kv usage, running ids) as schedule() left them; read now (after
        the update) when no `step_scheduled` call came for this step."""
        planned, self._planned = self._planned, None
        if planned is not None:
            return planned
        scheduler = self.scheduler
        return (scheduler.num_running, scheduler.num_waiting, self.kv.usage(),
                [r.request_id for r in scheduler.running])

    # ---- request records -----------------------------------------------------------------
    def _note_new(self, out: SchedulerOutput, now: float, outputs: list) -> None:
        finished_now = {o.request.request_id: o.request for o in outputs}
        for new in out.scheduled_new_reqs:
            if new.req_id in self._open:
                continue  # re-admitted after a preemption
            request = self.scheduler.requests.get(new.req_id) or finished_now.get(new.req_id)
            if request is None:
                continue
            record = {"id": request.request_id, "arrival": request.arrival_time,
                      "first_scheduled": now, "first_token": None, "finished": None,
                      "prompt_len": request.num_prompt_tokens,
                      "ttft_slo_ms": request.ttft_slo_ms, "priority": request.priority}
            self._open[request.request_id] = (record, request)
            for sink in self.sinks:
                sink.add_request(record)

    def _note_outputs(self, outputs: list) -> None:
        for output in outputs:
            entry = self._open.get(output.request.request_id)
            if entry is not None and entry[0]["first_token"] is None:
                entry[0]["first_token"] = output.request.first_token_time

    def _close_finished(self, request_ids) -> None:
        """Requests that left the scheduler (finished, aborted, failed): final record."""
        for rid in request_ids:
            entry = self._open.pop(rid, None)
            if entry is None:
                continue
            record, request = entry
            record.update(first_token=request.first_token_time,
                          finished=request.finished_time,
                          output_len=request.num_output_tokens,
                          preemptions=request.num_preemptions)
            for sink in self.sinks:
                sink.add_request(record)


def runner_phases(runner_out: ModelRunnerOutput, execute_seconds: float) -> dict[str, float]:
    """The runner's own split of its step, else the whole execute call as `execute`."""
    return dict(runner_out.phase_seconds) if runner_out.phase_seconds else {
        "execute": execute_seconds}


def computed_before(out: SchedulerOutput) -> dict[str, int]:
    """Request id -> num_computed_tokens before the step, as the SchedulerOutput tells it."""
    before = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    before.update(zip(out.cached_req_ids, out.cached_num_computed_tokens))
    return before


def chrome_path_for(path: str | Path) -> Path:
    """Where `--trace run.jsonl` puts its Chrome/Perfetto form: run.chrome.json."""
    path = Path(path)
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    return path.with_name(stem + ".chrome.json")


class JsonlSink:
    """Writes step records as they come and request records once finished (records.py
    format); at close, the unfinished requests too, then the Chrome/Perfetto form of the whole
    file next to it (`chrome_path_for`). Writes are buffered: a step costs one json.dumps."""

    def __init__(self, path: str | Path, meta: Optional[dict] = None, chrome: bool = True) -> None:
        self.path = Path(path)
        self.chrome = chrome
        self._file = open(self.path, "w", buffering=1 << 16)
        self._unfinished: dict[str, dict] = {}
        self._file.write(json.dumps({"type": "meta", "source": "engine", **(meta or {})}) + "\n")

    def add_step(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def add_request(self, record: dict) -> None:
        if record.get("finished") is None:
            self._unfinished[record["id"]] = record
            return
        self._unfinished.pop(record["id"], None)
        self._file.write(json.dumps({"type": "request", **record}) + "\n")

    def close(self) -> None:
        if self._file.closed:
            return
        for record in self._unfinished.values():
            self._file.write(json.dumps({"type": "request", **record}) + "\n")
        self._unfinished.clear()
        self._file.close()
        if self.chrome:
            from tokenweir.timeline.chrome import write_chrome_from_records
            write_chrome_from_records(self.path, chrome_path_for(self.path))


def attach_tracer(core, sink: StepSink) -> StepTracer:
    """Add `sink` to the core's tracer, making a tracer one of its step observers if it has
    none."""
    tracer = next((o for o in core.step_observers if isinstance(o, StepTracer)), None)
    if tracer is None:
        tracer = StepTracer(core.scheduler, [], has_work=core.has_unfinished_requests)
        core.schedule_listeners.append(tracer.step_scheduled)
        core.step_observers.append(tracer)
    tracer.sinks.append(sink)
    return tracer
