"""The discrete-event loop: the real Scheduler and a SimRunner on a virtual clock.

Events sit in a heap keyed (time, kind, sequence): ties break by kind (arrivals, then step
ends, then wake-ups), then by insertion order, so a run is a pure function of its inputs.
The engine loop: an arrival while idle queues a wake-up at the same instant (so every request
arriving at that instant joins the first step); a wake-up or a step end schedules the next
step, whose end lands `step_seconds` later; at a step's end, `update_from_output` runs with
`now` = that end time.
"""

from __future__ import annotations

import gc
import heapq
from collections import Counter
import time
from array import array
from typing import Union
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.config import EngineConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.core.sched.scheduler import Scheduler, SchedulerStats
from tokenweir.request import Request, SamplingParams
from tokenweir.runner.sim_runner import DEFAULT_EOS, SimRunner
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.slo_cuts import setup_slo
from tokenweir.sim.workload import RequestSpec

ARRIVAL, STEP_END, WAKE = 0, 1, 2
_MAX_EMPTY_STEPS = 1000
_EOS = frozenset({DEFAULT_EOS})


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival: float
    prompt_len: int
    target_output_len: int
    priority: int
    ttft_slo_ms: Optional[float]
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None
    num_output: int = 0
    finish_reason: Optional[str] = None
    num_finishes: int = 0  # conservation probe: must end at exactly 1
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class StepRecord:
    start: float
    seconds: float
    num_reqs: int
    num_decode_reqs: int  # requests scheduled for exactly one token
    num_tokens: int
    kv_usage: float  # after scheduling: the pool as this step uses it
    num_running: int
    num_waiting: int


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
        kv = KVCacheManager(num_blocks, config.cache.block_size,
                            enable_prefix_caching=config.cache.enable_prefix_caching,
                            num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, kv, max_model_len, costs=costs)
        self.targets: dict[str, int] = {}
        self.runner = SimRunner(latency_model, self.targets, check=check)
        self.cutter = setup_slo(config, self.scheduler, self.runner, latency_model,
                                max_model_len)
        self._inflight = None  # the runner output the next valid STEP_END carries
        self._inflight_out = None  # and the step it belongs to
        self.specs = sorted(specs, key=lambda s: (s.arrival, s.index))
        self.max_model_len = max_model_len
        self.record_steps, self.record_itl, self.check = record_steps, record_itl, check
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.itl: Union[array, ValueCounts] = ValueCounts() if itl_counts else array("d")
        self._last_token: dict[str, float] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._busy = False
        self._wake_pending = False
        self._empty_steps = 0  # steps in a row that only preempted

    # ---- events ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self) -> SimResult:
        """Run to the end. The cyclic garbage collector is paused meanwhile: the loop makes no
        reference cycles (a test checks that a collection afterwards finds nothing), and at
        100k requests the collector's passes over the growing heap cost ~10% of the run."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

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
                self._finish_step(payload, now)
                self._start_step(now)
            else:
                self._wake_pending = False
                if not self._busy:
                    self._start_step(now)
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"simulation stalled at t={now:.3f}s with {self.scheduler.num_waiting} waiting "
                f"and {self.scheduler.num_running} running requests that cannot be scheduled")
        kv = self.scheduler.kv
        return SimResult(list(self.records.values()), self.steps, self.itl,
                         self.scheduler.stats, now, time.perf_counter() - started,
                         kv.prefix_stats.hits, kv.prefix_stats.queries)

    def _arrive(self, spec: RequestSpec, now: float) -> None:
        max_tokens = max(1, min(spec.output_len, self.max_model_len - spec.prompt_len))
        request = Request(request_id=spec.request_id, prompt_token_ids=spec.prompt_tokens(),
                          sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                          max_tokens=max_tokens, arrival_time=now, priority=spec.priority,
                          eos_token_ids=_EOS, ttft_slo_ms=spec.ttft_slo_ms)
        self.targets[spec.request_id] = spec.output_len
        self.records[spec.request_id] = RequestRecord(
            spec.request_id, now, spec.prompt_len, spec.output_len, spec.priority,
            spec.ttft_slo_ms)
        self.scheduler.add_request(request)
        if self.cutter is not None and self._busy:
            self._cut_if_ordered(request, now)

    def _cut_if_ordered(self, request: Request, now: float) -> None:
        cut = self.cutter.on_arrival(request, now)
        if cut is None:
            return
        end, runner_out = cut
        out = self._inflight_out
        self._inflight = runner_out
        if self.record_steps:
            self.steps[-1].seconds = runner_out.step_seconds
        self._push(end, STEP_END, (out, runner_out))

    # ---- the engine loop ---------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        scheduler = self.scheduler
        if not scheduler.has_unfinished_requests():
            self._busy = False
            return
        out = scheduler.schedule(now)
        if out.is_empty:
            # Nothing fits; the finished/preempted ids still reach the runner.
            self.runner.execute(out)
            self._busy = False
            if out.preempted_req_ids or out.blocks_to_swap_out:
                # This step only preempted (a step that preempts admits nobody): the victims
                # can be re-admitted next step, so step again now, as the engine's loop would,
                # instead of idling until an arrival that may never come.
                self._empty_steps += 1
                if self._empty_steps > _MAX_EMPTY_STEPS:
                    raise RuntimeError(f"simulation livelocked at t={now:.3f}s: "
                                       f"{_MAX_EMPTY_STEPS} steps in a row only preempted")
                self._wake_pending = True
                self._push(now, WAKE)
            return
        self._empty_steps = 0
        runner_out = self.runner.execute(out)
        seconds = runner_out.step_seconds
        if self.record_steps:
            counts = out.num_scheduled_tokens
            decodes = list(counts.values()).count(1)  # requests scheduled for one token
            self.steps.append(StepRecord(now, seconds, len(counts), decodes,
                                         out.total_num_scheduled_tokens, scheduler.kv.usage(),
                                         scheduler.num_running, scheduler.num_waiting))
        self._busy = True
        self._inflight, self._inflight_out = runner_out, out
        if self.cutter is not None:
            self.cutter.step_started(now, seconds, out)
        self._push(now + seconds, STEP_END, (out, runner_out))

    def _finish_step(self, payload, now: float) -> None:
        out, runner_out = payload
        if runner_out.cut is not None:
            cut = runner_out.cut
            self.scheduler.roll_back_cut_step(out, cut.victim_id, cut.layer_index, cut.num_layers,
                                              cut.waiter_id)
            if self.check:
                self.scheduler.check_integrity()
            return
        records, last_token = self.records, self._last_token
        # Gaps end now. In order: appended one by one. As counts: count each gap's start, then
        # add one value per distinct start (most requests share the previous step's end).
        in_order = self.record_itl and isinstance(self.itl, array)
        gap_starts: dict[float, int] = {}
        # As counts, plain decodes come back as ids only (no per-token output objects).
        decoded: Optional[list[str]] = None if in_order else []
        update = self.scheduler.update_from_output
        outputs = update(out, runner_out, now) if decoded is None else \
            update(out, runner_out, now, decoded)
        if decoded:  # one more token each, neither the request's first nor its last
            gap_starts = Counter(map(last_token.__getitem__, decoded))
            last_token.update(dict.fromkeys(decoded, now))
        for eco in outputs:
            rid = eco.request.request_id
            previous = last_token.get(rid)
            if previous is None:
                record = records[rid]
                record.first_token = now
                record.first_scheduled = eco.request.first_scheduled_time
            elif in_order:
                self.itl.append(now - previous)
            else:
                gap_starts[previous] = gap_starts.get(previous, 0) + 1
            last_token[rid] = now
            if eco.finish_reason is not None:
                request = eco.request
                record = records[rid]
                record.num_output = request.num_output_tokens  # every output token came here
                record.finished = now
                record.finish_reason = eco.finish_reason
                record.num_finishes += 1
                record.num_preemptions = request.num_preemptions
                record.num_cached_tokens = max(0, request.num_cached_tokens)
                del last_token[rid]
                del self.targets[rid]
        if gap_starts and self.record_itl:
            for previous, count in gap_starts.items():
                self.itl.add(now - previous, count)
        if self.check:
            self.scheduler.check_integrity()
