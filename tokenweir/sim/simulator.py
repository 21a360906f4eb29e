"""The discrete-event loop: the real Scheduler and a SimRunner on a virtual clock.

Events sit in a heap keyed (time, kind, sequence): ties break by kind (arrivals, then step
ends, then wake-ups), then by insertion order, so a run is a pure function of its inputs.
The engine loop: an arrival while idle queues a wake-up at the same instant (so every request
arriving at that instant joins the first step); a wake-up or a step end schedules the next
step, whose end lands `step_seconds` later; at a step's end, `update_from_output` runs with
`now` = that end time. What a step does is SimEngine's (sim_engine.py), shared with the
cluster's instances; this file only decides when steps start and end.
"""

from __future__ import annotations

import heapq
import time
from array import array
from dataclasses import dataclass, field
from typing import Optional, Union

from tokenweir.config import EngineConfig
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.core.sched.scheduler import SchedulerStats
from tokenweir.request import Request
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.sim_engine import (RequestRecord, SimEngine, StepRecord, gc_paused,
                                      make_request)
from tokenweir.sim.slo_cuts import setup_slo
from tokenweir.sim.workload import RequestSpec

ARRIVAL, STEP_END, WAKE = 0, 1, 2


@dataclass
class SimResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    # Every inter-token gap (seconds), over all requests: in order (array), or as exact
    # value -> count (ValueCounts, Simulation(itl_counts=True); memory grows with steps only).
    itl: Union[array, ValueCounts]
    stats: SchedulerStats
    end_time: float
    wall_seconds: float
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    extra: dict = field(default_factory=dict)


class Simulation:
    def __init__(self, config: EngineConfig, latency_model, specs: list[RequestSpec],
                 num_blocks: int, max_model_len: int, num_host_blocks: int = 0,
                 costs: Optional[PreemptionCosts] = None, record_steps: bool = True,
                 record_itl: bool = True, check: bool = False,
                 itl_counts: bool = False) -> None:
        self.config = config
        self.engine = SimEngine(config, latency_model, num_blocks, max_model_len,
                                num_host_blocks, costs, record_steps=record_steps,
                                record_itl=record_itl, itl_counts=itl_counts, check=check)
        self.scheduler, self.runner = self.engine.scheduler, self.engine.runner
        self.cutter = setup_slo(config, self.scheduler, self.runner, latency_model,
                                max_model_len)
        self._inflight = None  # the runner output the next valid STEP_END carries
        self._inflight_out = None  # and the step it belongs to
        self.specs = sorted(specs, key=lambda s: (s.arrival, s.index))
        self.max_model_len = max_model_len
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._busy = False
        self._wake_pending = False

    @property
    def steps(self) -> list[StepRecord]:
        return self.engine.steps

    # ---- events ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self) -> SimResult:
        """Run to the end. The cyclic garbage collector is paused meanwhile: the loop makes no
        reference cycles (a test checks that a collection afterwards finds nothing), and at
        100k requests the collector's passes over the growing heap cost ~10% of the run."""
        with gc_paused():
            return self._run()

    def _run(self) -> SimResult:
        started = time.perf_counter()
        next_arrival = 0
        if self.specs:
            self._push(self.specs[0].arrival, ARRIVAL, 0)
        now = 0.0
        while self._heap:
            now, kind, _, payload = heapq.heappop(self._heap)
            if kind == ARRIVAL:
                self._arrive(self.specs[payload], now)
                next_arrival = payload + 1
                if next_arrival < len(self.specs):
                    self._push(self.specs[next_arrival].arrival, ARRIVAL, next_arrival)
                if not self._busy and not self._wake_pending:
                    self._wake_pending = True
                    self._push(now, WAKE)
            elif kind == STEP_END:
                if payload[1] is not self._inflight:
                    continue  # superseded by a mid-step cut
                self.engine.complete_step(payload[0], payload[1], now)
                self._start_step(now)
            else:
                self._wake_pending = False
                if not self._busy:
                    self._start_step(now)
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"simulation stalled at t={now:.3f}s with {self.scheduler.num_waiting} waiting "
                f"and {self.scheduler.num_running} running requests that cannot be scheduled")
        engine, kv = self.engine, self.engine.kv
        return SimResult(list(engine.records.values()), engine.steps, engine.itl,
                         self.scheduler.stats, now, time.perf_counter() - started,
                         kv.prefix_stats.hits, kv.prefix_stats.queries)

    def _arrive(self, spec: RequestSpec, now: float) -> None:
        request = make_request(spec.request_id, spec.prompt_tokens(), spec.output_len,
                               self.max_model_len, now, spec.priority, spec.ttft_slo_ms)
        self.engine.add_request(request, spec.output_len, spec.ttft_slo_ms)
        if self.cutter is not None and self._busy:
            self._cut_if_ordered(request, now)

    def _cut_if_ordered(self, request: Request, now: float) -> None:
        cut = self.cutter.on_arrival(request, now)
        if cut is None:
            return
        end, runner_out = cut
        out = self._inflight_out
        self._inflight = runner_out
        if self.engine.record_steps:
            self.steps[-1].seconds = runner_out.step_seconds
        self._push(end, STEP_END, (out, runner_out))

    # ---- the engine loop ---------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        engine = self.engine
        step = engine.start_step(now)
        if step is None:
            self._busy = False
            if engine.step_again:
                # This step only preempted (a step that preempts admits nobody): the victims
                # can be re-admitted next step, so step again now, as the engine's loop would,
                # instead of idling until an arrival that may never come.
                self._wake_pending = True
                self._push(now, WAKE)
            return
        out, runner_out = step
        seconds = runner_out.step_seconds
        engine.record_step(now, seconds, out)
        self._busy = True
        self._inflight, self._inflight_out = runner_out, out
        if self.cutter is not None:
            self.cutter.step_started(now, seconds, out)
        self._push(now + seconds, STEP_END, (out, runner_out))
