"""One engine on the virtual clock: the real Scheduler and KVCacheManager, a SimRunner, and the
records its steps leave. Each instance (instance.py) is one, driven by the simulator's one event
loop (simulator.py). Whatever a step does, planning through bookkeeping, is written here once;
the loop only decides when steps start and end.

A loop calls, per step: `start_step(now)` (schedule and execute; None when nothing runs),
`record_step(now, seconds, out)`, and, when the step ends, `complete_step(out, runner_out, end)`.

Inter-token gaps are kept in order (an array; optionally with each gap's end time and request
id), or as exact value -> count (`itl_counts`), or not at all (`record_itl=False`); in the last
two cases plain decodes come back from the scheduler as ids only (its bulk path) and are
counted without a per-token Python loop.
"""

from __future__ import annotations

import contextlib
import gc
from functools import lru_cache

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Union

from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.request import Request, SamplingParams
from tokenweir.sim.sim_runner import DEFAULT_EOS, SimRunner
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.setup import EngineSetup, Recording


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector for a simulation run: the loop makes no reference
    cycles (tests check that a collection afterwards finds nothing), and at 100k requests
    the collector's passes over the growing heap cost ~10% of the run. On resuming, what the
    run left alive goes to the oldest generation without a pass (`_age_without_a_pass`)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            _age_without_a_pass()
            gc.enable()


def _age_without_a_pass() -> None:
    """Move every tracked object to the oldest generation, where the next full collection
    examines it, without a pass now. Resumed plainly, the collector's first allocation
    triggered a young-generation pass over everything the paused run allocated and kept
    (it finds nothing: the run makes no cycles): 0.6 s of a 20k x 64 cluster run (contended;
    issue 36, simc14), growing with the heap. `freeze` then `unfreeze` is that move, two list
    splices; skipped where the process has frozen objects of its own (startup_gc.py), which
    `unfreeze` would thaw."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


_EOS = frozenset({DEFAULT_EOS})
MAX_EMPTY_STEPS = 1000  # steps in a row that only preempted before a run is called livelocked


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


def make_request(request_id: str, tokens: list[int], output_len: int, max_model_len: int,
                 arrival: float, priority: int = 0,
                 ttft_slo_ms: Optional[float] = None) -> Request:
    """A greedy request whose output is capped to fit max_model_len (EOS comes from the
    runner's target, `output_len`)."""
    max_tokens = max(1, min(output_len, max_model_len - len(tokens)))
    return Request(request_id=request_id, prompt_token_ids=tokens,
                   sampling_params=greedy_params(max_tokens),
                   max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                   eos_token_ids=_EOS, ttft_slo_ms=ttft_slo_ms)


@lru_cache(maxsize=None)
def greedy_params(max_tokens: int) -> SamplingParams:
    """SamplingParams(temperature=0, max_tokens=max_tokens), made and validated once per
    length for the whole process and shared by the requests that ask for it (nothing changes
    a request's params; validating them per request was ~1% of a cluster run)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens)


class SimEngine:
    def __init__(self, setup: EngineSetup, recording: Recording = Recording()) -> None:
        """The engine `setup` describes (its config, latency model, pools and preemption
        costs), keeping what `recording` asks of its run."""
        config = setup.config
        self.kv = KVCacheManager(setup.num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 num_host_blocks=setup.num_host_blocks,
                                 # a sliding-window model's blocks that slid out are freed
                                 sliding_window=getattr(setup.model, "attention_window", None))
        self.scheduler = Scheduler(config.scheduler, self.kv, setup.max_model_len,
                                   costs=setup.costs)
        self.targets: dict[str, int] = {}  # request id -> output length (EOS); runner reads it
        self.runner = SimRunner(setup.model, self.targets, check=recording.check)
        self.max_model_len = setup.max_model_len
        self.record_steps, self.record_itl = recording.record_steps, recording.record_itl
        self.check = recording.check
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        # Every inter-token gap (seconds): in order, or as exact value -> count.
        self.itl: Union[array, ValueCounts] = (ValueCounts() if recording.itl_counts
                                               else array("d"))
        # gap ends, with recording.record_itl_times
        self.itl_times: Optional[array] = array("d") if recording.record_itl_times else None
        self.itl_ids: list[str] = []  # with itl_times: whose gap each one is
        self._last_token: dict[str, float] = {}  # running request id -> its last token's time
        # Set by a start_step that ran nothing but preempted (its requester was its own
        # victim): the victims can be re-admitted, so the loop should step again at once.
        self.step_again = False
        self._empty_steps = 0  # such steps in a row

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request, target_output_len: int,
                    ttft_slo_ms: Optional[float] = None) -> None:
        rid = request.request_id
        self.targets[rid] = target_output_len
        self.records[rid] = RequestRecord(rid, request.arrival_time, request.num_prompt_tokens,
                                          target_output_len, request.priority, ttft_slo_ms)
        self.scheduler.add_request(request)

    # ---- a step ----------------------------------------------------------------------------
    def _schedule(self, now: float) -> Optional[SchedulerOutput]:
        """The next step's plan, or None when none can be planned (hook for pipelining)."""
        return self.scheduler.schedule(now)

    def start_step(self, now: float) -> Optional[tuple[SchedulerOutput, ModelRunnerOutput]]:
        """Schedule and execute a step at `now`; None when it computes nothing (the ids
        finished or preempted since the last step still reach the runner; `step_again` tells
        whether the empty step preempted)."""
        self.step_again = False
        if not self.scheduler.has_unfinished_requests():
            return None
        out = self._schedule(now)
        if out is None:
            return None
        runner_out = self.runner.execute(out)
        if not out.is_empty:
            self._empty_steps = 0
            return out, runner_out
        if out.preempted_req_ids or out.blocks_to_swap_out:
            self._empty_steps += 1
            if self._empty_steps > MAX_EMPTY_STEPS:
                raise RuntimeError(f"simulation livelocked at t={now:.3f}s: "
                                   f"{MAX_EMPTY_STEPS} steps in a row only preempted")
            self.step_again = True
        return None

    def record_step(self, now: float, seconds: float, out: SchedulerOutput) -> None:
        """A StepRecord for a step that started at `now` and lasts `seconds` (when recording)."""
        if not self.record_steps:
            return
        counts = out.num_scheduled_tokens
        decodes = list(counts.values()).count(1)  # requests scheduled for one token
        scheduler = self.scheduler
        self.steps.append(StepRecord(now, seconds, len(counts), decodes,
                                     out.total_num_scheduled_tokens, self.kv.usage(),
                                     scheduler.num_running, scheduler.num_waiting))

    def complete_step(self, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                      now: float) -> list[EngineCoreOutput]:
        """The step planned as `out` ended at `now`: update the scheduler (or roll back a step
        cut mid-way) and the records. Returns the scheduler's outputs: every first token and
        every finish is among them; plain decodes are too unless gaps are kept as counts."""
        scheduler = self.scheduler
        if runner_out.cut is not None:
            cut = runner_out.cut
            scheduler.roll_back_cut_step(out, cut.victim_id, cut.layer_index, cut.num_layers,
                                         cut.waiter_id)
            if self.check:
                scheduler.check_integrity()
            return []
        if self.record_itl and not isinstance(self.itl, ValueCounts):  # gaps in order
            outputs = scheduler.update_from_output(out, runner_out, now)
            self._record_outputs_in_order(outputs, now)
        else:
            decoded: list[str] = []  # one more token each, neither the request's first nor last
            outputs = scheduler.update_from_output(out, runner_out, now, decoded)
            self._record_outputs_as_counts(decoded, outputs, now)
        if self.check:
            scheduler.check_integrity()
        return outputs

    # ---- records -------------------------------------------------------------------------
    def _record_outputs_in_order(self, outputs: list[EngineCoreOutput], now: float) -> None:
        last_token, itl, times = self._last_token, self.itl, self.itl_times
        for eco in outputs:
            rid = eco.request.request_id
            previous = last_token.get(rid)
            if previous is None:
                self._first_token(eco.request, now)
            else:
                itl.append(now - previous)
                if times is not None:
                    times.append(now)
                    self.itl_ids.append(rid)
            last_token[rid] = now
            if eco.finish_reason is not None:
                self._finished(eco, now)

    def _record_outputs_as_counts(self, decoded: list[str], outputs: list[EngineCoreOutput],
                                  now: float) -> None:
        """Count each gap's start, then add one value per distinct start (most requests share
        the previous step's end). Also the path when gaps are not recorded at all."""
        last_token = self._last_token
        gap_starts = _count(list(map(last_token.__getitem__, decoded)))
        last_token.update(dict.fromkeys(decoded, now))
        for eco in outputs:
            rid = eco.request.request_id
            previous = last_token.get(rid)
            if previous is None:
                self._first_token(eco.request, now)
            else:
                gap_starts[previous] = gap_starts.get(previous, 0) + 1
            last_token[rid] = now
            if eco.finish_reason is not None:
                self._finished(eco, now)
        if self.record_itl:
            add = self.itl.add
            for previous, count in gap_starts.items():
                add(now - previous, count)

    def _first_token(self, request: Request, now: float) -> None:
        record = self.records[request.request_id]
        record.first_token = now
        record.first_scheduled = request.first_scheduled_time

    def _finished(self, eco: EngineCoreOutput, now: float) -> None:
        request = eco.request
        rid = request.request_id
        record = self.records[rid]
        record.num_output = request.num_output_tokens  # every output token came here
        record.finished = now
        record.finish_reason = eco.finish_reason
        record.num_finishes += 1
        record.num_preemptions = request.num_preemptions
        record.num_cached_tokens = max(0, request.num_cached_tokens)
        del self._last_token[rid]
        del self.targets[rid]


def _count(values: list[float]) -> dict[float, int]:
    """value -> count, in order of first appearance. Usually every value is the same (each
    decoded request's previous token came at the previous step's end): one C-level pass."""
    if not values:  # a step whose outputs hold no plain decode (one beside a stretch's rows)
        return {}
    if values.count(values[0]) == len(values):
        return {values[0]: len(values)}
    return dict(Counter(values))
