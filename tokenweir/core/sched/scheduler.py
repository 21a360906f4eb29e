"""The token-budget scheduler (vLLM v1 semantics).

There is no prefill phase and no decode phase. Each step hands out `max_num_batched_tokens`:
running requests first (in admission order), then waiting ones. A request asks for what it
still owes (`num_tokens - num_computed_tokens`), clamped by `long_prefill_token_threshold` and
by the budget left; chunked prefill is what the budget does to a long prompt.

When `allocate_slots` returns None, the scheduler sheds load: it preempts a victim and retries;
if the victim is the request itself, that request waits. A victim goes to the front of the
waiting queue with its output tokens kept, and either loses its KV (recompute: blocks freed,
`num_computed_tokens` reset to 0) or has it copied to a host pool (swap: resumes where it
stopped once copied back). A step that preempted admits nobody new.

With prefix caching a new request starts from the longest run of its leading full blocks
already in the cache (`num_computed_tokens` = the hit).

No torch, no clocks: `now` is passed in by whoever drives the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import (ModelRunnerOutput, NewRequestData, SchedulerOutput,
                                    TokenLogprobs)
from tokenweir.core.sched import policy, slo
from tokenweir.core.sched.policy import SWAP, PreemptionCosts, PreemptionPlan
from tokenweir.core.sched.queues import make_queue
from tokenweir.request import Request, RequestStatus


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request (new tokens, and whether it finished)."""

    request: Request
    new_token_ids: list[int]
    logprobs: Optional[TokenLogprobs] = None
    finish_reason: Optional[str] = None


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefill_steps: int = 0  # prefill chunks that stopped short of the prompt's end
    prompt_tokens: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    generation_tokens: int = 0
    last_iteration_tokens: int = 0
    num_swapped_out: int = 0  # preemptions that swapped (requests)
    num_swapped_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    # Preemption events by cause (MEMORY, SLO_BETWEEN_STEPS: a prefill paused or freed for an
    # urgent waiter, SLO_MID_STEP: a step cut at a layer boundary). `num_preemptions` counts
    # the requests sent back to the waiting queue, whatever the cause.
    preemptions_by_cause: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(PREEMPTION_CAUSES, 0))
    slo_cut_steps: int = 0
    slo_wasted_layer_tokens: int = 0  # sum over cut steps of tokens x layers run, discarded
    slo_total_layer_tokens: int = 0  # sum over cut steps of tokens x all layers
    # TTFT attainment per request class (the request's priority, as a string): [met, missed]
    slo_attainment: dict[str, list[int]] = field(default_factory=dict)


MEMORY, SLO_BETWEEN_STEPS, SLO_MID_STEP = "memory", "slo-between-steps", "slo-mid-step"
PREEMPTION_CAUSES = (MEMORY, SLO_BETWEEN_STEPS, SLO_MID_STEP)


@dataclass(slots=True)
class _StepPlan:
    """What one schedule() call has decided so far."""

    token_budget: int
    now: float = 0.0
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    # The running requests scheduled, in order, and their computed tokens before this step:
    # the output's `cached_req_ids` / `cached_num_computed_tokens`, built as they are added.
    cached_req_ids: list[str] = field(default_factory=list)
    cached_num_computed: list[int] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_chunked: int = 0  # scheduled prefill chunks that stop short of their prompt's end
    preempted: list[Request] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    paused: set[str] = field(default_factory=set)  # running prefills skipped for an urgent waiter
    slo_waiter: Optional[str] = None  # the urgent waiter a victim was paused for this step
    slo_victim: Optional[str] = None
    # slo policy: a prefill at risk of missing its deadline is in this step, so no other
    # prefill joins it (its chunk would lengthen the step the deadline waits on)
    prefills_closed: bool = False

    def add(self, request: Request, num_tokens: int, block_ids: list[int], is_new: bool) -> None:
        rid = request.request_id
        self.num_scheduled[rid] = num_tokens
        self.new_block_ids[rid] = block_ids
        if is_new:
            self.new_reqs.append(request)
        else:
            self.cached_req_ids.append(rid)
            self.cached_num_computed.append(request.num_computed_tokens)
        if _stops_short_of_prompt(request, num_tokens):
            self.num_chunked += 1
        self.token_budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo `add` for a request preempted later in the same step."""
        rid = request.request_id
        num_tokens = self.num_scheduled.pop(rid, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.new_block_ids.pop(rid, None)
        if _stops_short_of_prompt(request, num_tokens):
            self.num_chunked -= 1
        if request in self.new_reqs:
            self.new_reqs.remove(request)
        else:
            k = self.cached_req_ids.index(rid)
            del self.cached_req_ids[k], self.cached_num_computed[k]


def _stops_short_of_prompt(request: Request, num_tokens: int) -> bool:
    """A chunk of `num_tokens` from the request's computed tokens ends inside its prompt (a
    chunked prefill step). Never true of a decode: it owes 1 token, the last it knows."""
    return request.num_computed_tokens + num_tokens < len(request.prompt_token_ids)


class _PartialPrefills:
    """How many requests are mid-prefill: the running ones when admission began (paused ones
    excluded), plus the admissions this step that got only part of their prompt. Only an
    admission that would itself be chunked asks, so the pass over `running` is made on the
    first ask, not on every step with a waiting request. Admissions append to `running`, and
    nothing else changes it while admitting, so its first `len` entries stay the ones that
    were running."""

    __slots__ = ("_running", "_paused", "_num_running", "_counted", "_admitted")

    def __init__(self, running: list[Request], paused: set[str]) -> None:
        self._running, self._paused, self._num_running = running, paused, len(running)
        self._counted: Optional[int] = None
        self._admitted = 0

    def value(self) -> int:
        if self._counted is None:
            self._counted = sum(1 for r in self._running[:self._num_running]
                                if policy.is_prefilling(r) and r.request_id not in self._paused)
        return self._counted + self._admitted

    def add_one(self) -> None:
        self._admitted += 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, costs: Optional[PreemptionCosts] = None) -> None:
        config.validate()
        self.config = config
        self.costs = costs or PreemptionCosts()
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self._check_pool_fits_one_sequence()
        self._check_budget_fits_one_sequence()
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        # Request id -> the length the decode fast path of update_from_output stays below:
        # prompt + max_tokens (the length cap), or 0 for a request with stop_token_ids, which
        # every token takes through the full stop rule. Read per token; the request's own
        # prompt and sampling params are not.
        self._fast_length_cap: dict[str, int] = {}
        self._finished_since_last_step: set[str] = set()
        self._preempted_since_last_step: set[str] = set()
        self.watermark_blocks = int(config.watermark * self.kv.num_usable_blocks)
        self.stats = SchedulerStats()
        self.slo_enabled = config.scheduling_policy == "slo"
        self.ttft_predictor = slo.TTFTPredictor(
            a=(config.slo_ttft_a_ms_per_token / 1000 if config.slo_ttft_a_ms_per_token is not None
               else self.costs.prefill_seconds_per_token),
            c=(config.slo_ttft_c_ms or 0.0) / 1000, b=config.slo_ttft_b_us_per_token2 / 1e6)
        # The latest StepSnapshot (slo policy): replaced whole after each schedule(), never
        # mutated, so a monitor thread may read it without a lock.
        self.slo_snapshot: Optional[slo.StepSnapshot] = None
        # Optional latency model (`predict(SchedulerOutput, context_lens) -> seconds`, e.g. the
        # simulator's or a calibrated one): how long the step in flight will take. Without it
        # the TTFT line is used, which ignores the context a chunk attends to.
        self.step_latency_model = None
        # victim id -> the urgent request it gave way to: the victim gets no tokens (running)
        # and is not admitted (waiting) until that request has its first token, so that its
        # re-prefill never shares (and lengthens) the urgent request's prefill steps.
        self._slo_holds: dict[str, str] = {}

    def _check_pool_fits_one_sequence(self) -> None:
        needed = self.kv.blocks_for_tokens(self.max_model_len)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"the KV pool is too small: one max_model_len={self.max_model_len} request needs "
                f"{needed} blocks of {self.kv.block_size} tokens but the pool has "
                f"{self.kv.num_usable_blocks} usable blocks; raise the pool size "
                f"(num_gpu_blocks_override / kv_cache_space) or lower max_model_len")

    def _check_budget_fits_one_sequence(self) -> None:
        """Without chunked prefill a request is (re)computed in one step: a longer one, or one
        preempted after growing past the budget, could never be scheduled."""
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill off, max_num_batched_tokens={budget} must be >= "
                f"max_model_len={self.max_model_len} (a longer prompt could never be scheduled); "
                f"raise the budget, lower max_model_len, or enable chunked prefill")

    # ---- requests in and out -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.max_num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt + max_tokens = "
                             f"{request.max_num_tokens} exceeds max_model_len={self.max_model_len}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._fast_length_cap[request.request_id] = (
            0 if request.sampling_params.stop_token_ids else request.max_num_tokens)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (abort) requests wherever they are; unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._fast_length_cap[request.request_id]
        self._finished_since_last_step.add(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # ---- schedule ----------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan one step. `now` (the caller's clock) only stamps first_scheduled_time."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens, now=now)
        if self.slo_enabled:
            plan.paused |= self._slo_active_holds()
            self._slo_order(now, plan.paused)
            self._slo_between_steps(plan)
        if self.config.prioritize_prefill:
            self._schedule_running(plan, prefills=True, decodes=False)
            self._schedule_waiting(plan)
            self._schedule_running(plan, prefills=False, decodes=True)
        else:
            self._schedule_running(plan, prefills=True, decodes=True)
            self._schedule_waiting(plan)
        if plan.slo_victim:
            self._slo_free_paused_if_memory_blocked(plan)
        output = self._make_output(plan)
        if self.slo_enabled:
            self.slo_snapshot = self._slo_make_snapshot(output, now)
        return output

    def _schedule_running(self, plan: _StepPlan, prefills: bool, decodes: bool) -> None:
        """Give running requests their next tokens; preempt victims when the pool is full."""
        i = 0
        running = self.running  # mutated in place only (remove, sort)
        scheduled, paused = plan.num_scheduled, plan.paused
        # One pass visits each request once; only a second pass (prioritize_prefill) meets
        # requests the first one scheduled.
        check_scheduled = bool(scheduled)
        allocate, block_size = self.kv.allocate_slots, self.kv.block_size
        cached_req_ids, cached_num_computed = plan.cached_req_ids, plan.cached_num_computed
        while i < len(running) and plan.token_budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            owed = len(request.all_token_ids) - computed
            rid = request.request_id
            if not (prefills if owed > 1 else decodes) or (check_scheduled and rid in scheduled) \
                    or (paused and rid in paused) or (owed > 1 and plan.prefills_closed):
                i += 1  # owed > 1: policy.is_prefilling
                continue
            if owed == 1 and computed % block_size:
                # The hot case: a decode (1 token, as the budget is > 0) whose computed tokens
                # end inside a block; a running request's blocks cover its computed tokens, so
                # it has room for its next one (allocate_slots would give []). No chunk, no
                # preemption, no new blocks (left out of new_block_ids): plan.add, inlined.
                scheduled[rid] = 1
                cached_req_ids.append(rid)
                cached_num_computed.append(computed)
                plan.token_budget -= 1
                i += 1
                continue
            num_tokens = 1 if owed == 1 else policy.num_tokens_to_schedule(
                owed, plan.token_budget, self.config.long_prefill_token_threshold)
            assert num_tokens > 0, f"running request {rid} owes no tokens"
            block_ids = allocate(request, num_tokens)
            if block_ids is None:
                block_ids = self._allocate_or_preempt(request, num_tokens, plan)
                if block_ids is None:
                    break  # the request itself was preempted: nothing later can be cheaper
            if plan.preempted:
                # A victim ahead of `request` in `running` (priority policy) shifted it left.
                while i >= len(running) or running[i] is not request:
                    i -= 1
            plan.add(request, num_tokens, block_ids, is_new=False)
            if owed > 1 and self.slo_enabled:
                self._slo_close_prefills_if_at_risk(request, plan)
            i += 1

    def _allocate_or_preempt(self, request: Request, num_tokens: int,
                             plan: _StepPlan) -> Optional[list[int]]:
        while True:
            block_ids = self.kv.allocate_slots(request, num_tokens)
            if block_ids is not None:
                return block_ids
            victim = policy.choose_victim(
                self.running, request, self.config.victim_policy,
                lambda r: self._preemption_plan(r).seconds, self.config.max_preemptions)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preemption_plan(self, request: Request) -> PreemptionPlan:
        """Swap or recompute, and what it costs; prefix-cache blocks shared with other holders
        survive a recompute and are not counted as lost."""
        lost_tokens = request.num_computed_tokens - self.kv.num_shared_tokens(request)
        return policy.plan_preemption(
            self.config.preemption_mode, lost_tokens,
            self.kv.num_swappable_blocks(request), self.kv.can_swap_out(request),
            self.costs)

    def _preempt(self, request: Request, plan: _StepPlan, cause: str = MEMORY,
                 count_cause: bool = True) -> None:
        """Send a running request back to the waiting queue. SLO preemptions always recompute
        (prefix caching keeps its full blocks findable) and do not stop admissions."""
        self.running.remove(request)
        plan.drop(request)
        if cause == MEMORY and self._preemption_plan(request).action == SWAP:
            pairs = self.kv.swap_out(request)
            plan.swap_out.extend(pairs)
            self.stats.num_swapped_out += 1
            self.stats.blocks_swapped_out += len(pairs)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if count_cause:
            self.stats.preemptions_by_cause[cause] += 1
        self.waiting.prepend(request)
        if cause == MEMORY:
            plan.preempted.append(request)
        self._preempted_since_last_step.add(request.request_id)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in queue order until one does not fit; never on a step
        that preempted."""
        if plan.preempted or not self.waiting:
            return
        num_partial = _PartialPrefills(self.running, plan.paused)
        while self.waiting and plan.token_budget > 0 and not plan.prefills_closed:
            if 0 < self.config.max_num_seqs <= len(self.running):
                break
            request = self.waiting.peek()
            if request.request_id in plan.paused:
                break  # an SLO victim held back: it and what sorts after it wait (slo only)
            admitted = self._try_admit(request, plan, num_partial)
            if admitted is None:
                break
            num_tokens, block_ids = admitted
            self.waiting.pop()
            if num_tokens < request.num_tokens - request.num_computed_tokens:
                num_partial.add_one()
            self._admit(request, plan.now)
            plan.add(request, num_tokens, block_ids, is_new=True)
            if self.slo_enabled:
                self._slo_close_prefills_if_at_risk(request, plan)

    def _try_admit(self, request: Request, plan: _StepPlan,
                   num_partial: _PartialPrefills) -> Optional[tuple[int, list[int]]]:
        """Admission control for the queue head: prefix-cache hit, chunk size, the watermark
        (only while something runs), the full-sequence check, then the allocation.
        Returns (tokens this step, new block ids), or None with nothing changed."""
        reserved = self.watermark_blocks if self.running else 0
        if self.kv.is_swapped(request.request_id):
            return self._try_swap_in(request, plan, num_partial, reserved)
        hits = self.kv.get_computed_blocks(request)
        num_hit_tokens = len(hits) * self.kv.block_size
        num_tokens = self._admission_chunk(request.num_tokens - num_hit_tokens,
                                           plan.token_budget, num_partial)
        if num_tokens == 0:
            return None
        if self.config.scheduler_reserve_full_isl:
            full_len = min(request.max_num_tokens, self.max_model_len)
            needed = (self.kv.blocks_for_tokens(full_len) - len(hits)
                      + sum(1 for b in hits if b.ref_cnt == 0))
            if not policy.full_sequence_fits(needed, self.kv.num_free_blocks, reserved):
                return None
        block_ids = self.kv.allocate_slots(request, num_tokens, computed_blocks=hits,
                                           reserved_blocks=reserved)
        if block_ids is None:
            return None
        request.num_computed_tokens = num_hit_tokens
        self.kv.record_admission(request, num_hit_tokens)
        return num_tokens, block_ids

    def _try_swap_in(self, request: Request, plan: _StepPlan, num_partial: _PartialPrefills,
                     reserved: int) -> Optional[tuple[int, list[int]]]:
        """Re-admit a swapped-out request: copy its blocks back, then room for its next tokens."""
        num_tokens = self._admission_chunk(request.num_tokens - request.num_computed_tokens,
                                           plan.token_budget, num_partial)
        if num_tokens == 0:
            return None
        swapped = self.kv.num_swapped_blocks(request.request_id)
        kept = self.kv.num_held_blocks(request.request_id)
        total = self.kv.blocks_for_tokens(request.num_computed_tokens + num_tokens)
        if max(swapped, total - kept) > self.kv.num_free_blocks - reserved:
            return None
        pairs = self.kv.swap_in(request, reserved)
        assert pairs is not None
        new_block_ids = self.kv.allocate_slots(request, num_tokens, reserved_blocks=reserved)
        assert new_block_ids is not None
        plan.swap_in.extend(pairs)
        self.stats.num_swapped_in += 1
        self.stats.blocks_swapped_in += len(pairs)
        return num_tokens, [device for _, device in pairs] + new_block_ids

    def _admission_chunk(self, owed: int, token_budget: int,
                         num_partial: _PartialPrefills) -> int:
        """Tokens the queue head gets this step out of `owed`, or 0 if it must keep waiting."""
        if not self.config.enable_chunked_prefill:
            return owed if owed <= token_budget else 0  # whole or not at all: no threshold
        num_tokens = policy.num_tokens_to_schedule(
            owed, token_budget, self.config.long_prefill_token_threshold)
        if num_tokens < owed and num_partial.value() >= self.config.max_num_partial_prefills:
            return 0
        return num_tokens

    def _admit(self, request: Request, now: float) -> None:
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        self.running.append(request)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs = [NewRequestData(
            req_id=r.request_id, token_ids=list(r.all_token_ids),
            num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.sampling_params,
            block_ids=self.kv.block_ids(r.request_id), num_computed_tokens=r.num_computed_tokens,
        ) for r in plan.new_reqs]
        total = sum(plan.num_scheduled.values())
        assert total <= self.config.max_num_batched_tokens
        self._count_step(plan, total)
        output = SchedulerOutput(  # the running requests' CachedRequestData is built when read
            scheduled_new_reqs=new_reqs, num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=total, cached_req_ids=plan.cached_req_ids,
            cached_num_computed_tokens=plan.cached_num_computed,
            new_block_ids=plan.new_block_ids,
            preempted_req_ids=self._preempted_since_last_step,
            finished_req_ids=self._finished_since_last_step, step_id=self.stats.num_steps,
            blocks_to_swap_in=plan.swap_in, blocks_to_swap_out=plan.swap_out)
        self._preempted_since_last_step = set()
        self._finished_since_last_step = set()
        return output

    def _count_step(self, plan: _StepPlan, total: int) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.last_iteration_tokens = total
        stats.num_chunked_prefill_steps += plan.num_chunked

    # ---- update ------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput, now: float = 0.0,
                           decoded: Optional[list[str]] = None) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, apply stop rules, free the finished.

        Requests aborted or preempted since `scheduler_output` was made are skipped.
        `decoded` (the simulator's bulk path; not with logprobs): when given, a request that
        got one token that is neither its first nor its last is listed there by id instead of
        getting an EngineCoreOutput; its token is in `all_token_ids` as always.
        """
        # The per-token path of the whole engine (and of the simulator): locals, not
        # attribute chains; calls only where something may happen.
        outputs: list[EngineCoreOutput] = []
        requests, running = self.requests, RequestStatus.RUNNING
        sampled, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        kv = self.kv
        register = kv.register_computed_blocks if kv.enable_prefix_caching else None
        block_size, behind = kv.block_size, kv.registration_behind
        fast_length_cap = self._fast_length_cap
        num_fast = 0
        bulk = decoded.append if decoded is not None and not logprobs else None
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None or request.status is not running:  # statuses are the members
                continue
            if request.num_preemptions:
                self._count_recomputed_tokens(request, num_tokens)
            computed = request.num_computed_tokens + num_tokens
            request.num_computed_tokens = computed
            if computed > request.max_computed_tokens:
                request.max_computed_tokens = computed
            if register is not None and (computed % block_size < num_tokens or (
                    behind and request_id in behind)):  # kv.needs_registration
                register(request)
            new_token_ids = sampled.get(request_id)
            if not new_token_ids:
                continue
            # Decode fast path: one token, not the first, that no stop rule can end (not an
            # EOS token id, the request has no stop token ids, below the length cap, which
            # add_request keeps within max_model_len): append it and move on. Everything else
            # takes _append_tokens and the full rule (_stop_status).
            token_id = new_token_ids[0]
            all_token_ids = request.all_token_ids
            if (len(all_token_ids) + 1 < fast_length_cap[request_id]
                    and request.first_token_time is not None and len(new_token_ids) == 1
                    and token_id not in request.eos_token_ids):
                all_token_ids.append(token_id)
                num_fast += 1
                if bulk is not None:
                    bulk(request_id)
                    continue
                output = EngineCoreOutput(request, [token_id])
            else:
                output = self._append_tokens(request, new_token_ids, now)
            if logprobs:
                output.logprobs = logprobs.get(request_id)
            outputs.append(output)
        self.stats.generation_tokens += num_fast
        return outputs

    def _count_recomputed_tokens(self, request: Request, num_tokens: int) -> None:
        """Tokens computed again after a preemption (the recompute tax): the part of this
        step's range that lies below the request's high-water mark. Called only for requests
        preempted at least once."""
        start = request.num_computed_tokens
        self.stats.recomputed_tokens += max(
            0, min(start + num_tokens, request.max_computed_tokens) - start)

    def _append_tokens(self, request: Request, token_ids: list[int],
                       now: float) -> EngineCoreOutput:
        if request.first_token_time is None:
            request.first_token_time = now
            self.stats.prompt_tokens += request.num_prompt_tokens
            self._count_attainment(request, now)
        appended: list[int] = []
        status: Optional[RequestStatus] = None
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                break
        self.stats.generation_tokens += len(appended)
        output = EngineCoreOutput(request=request, new_token_ids=appended)
        if status is not None:
            self.running.remove(request)
            request.finished_time = now
            self._finish(request, status)
            output.finish_reason = status.finish_reason
        return output

    def _stop_status(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        """vLLM's stop rules: EOS, then stop_token_ids, both held off until min_tokens; then
        length. The length cap is hard: `request.max_tokens` (capped to max_model_len) may be
        below min_tokens."""
        params = request.sampling_params
        num_output_tokens = request.num_output_tokens
        if num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ---- slo policy --------------------------------------------------------------------
    _SNAPSHOT_WAITERS = 8  # the gate reads the head of the EDF order; a few suffice

    def _ttft_deadline(self, request: Request) -> Optional[float]:
        """The deadline that still matters: None once the first token came."""
        return None if request.first_token_time is not None else request.ttft_deadline

    def _edf_key(self, request: Request, now: float) -> float:
        deadline = self._ttft_deadline(request)
        predicted = self._slo_predicted_ttft(request)
        return slo.edf_key(slo.slack(deadline, now, predicted), deadline, now,
                           slo.hopeless_below(predicted, self.config.slo_hopeless_tolerance))

    def _slo_close_prefills_if_at_risk(self, request: Request, plan: _StepPlan) -> None:
        """A prefill at risk runs with decodes only: another prefill's chunk in the same step
        would add its cost, attention over its whole context included, to the time the deadline
        waits on. At risk: a deadline, and less slack than the larger of its own predicted TTFT
        and one full token budget's prefill (what a co-scheduled chunk can cost)."""
        deadline = self._ttft_deadline(request)
        if deadline is None or not self.config.slo_isolate_at_risk_prefill:
            return
        predicted = self._slo_predicted_ttft(request)
        one_budget = self.ttft_predictor.predict(self.config.max_num_batched_tokens)
        if slo.slack(deadline, plan.now, predicted) < max(predicted, one_budget):
            plan.prefills_closed = True

    def _slo_active_holds(self) -> set[str]:
        """Victims still held back; a hold ends when its urgent request has its first token,
        is gone, or is itself held (so holds never form a cycle that nothing can break)."""
        for victim_id, waiter_id in list(self._slo_holds.items()):
            waiter = self.requests.get(waiter_id)
            if waiter is None or waiter.first_token_time is not None or \
                    victim_id not in self.requests or waiter_id in self._slo_holds:
                del self._slo_holds[victim_id]
        return set(self._slo_holds)

    def _slo_order(self, now: float, held: set[str]) -> None:
        """Waiting queue in EDF order, held victims last; running decodes first (admission
        order), then running prefills most urgent first, so an admitted urgent request gets
        its chunks first."""
        self.waiting.reorder(lambda r: -math.inf if r.request_id in held
                             else self._edf_key(r, now))
        self.running.sort(key=lambda r: (1, -self._edf_key(r, now))
                          if policy.is_prefilling(r) else (0, 0.0))

    def _prefill_view(self, request: Request) -> slo.PrefillView:
        return slo.PrefillView(request.request_id, self._ttft_deadline(request),
                               request.num_tokens - request.num_computed_tokens,
                               request.num_slo_preemptions, request.num_computed_tokens)

    def _slo_done_tokens(self, request: Request) -> int:
        """Tokens a TTFT prediction may count as done: the computed ones, or for a request
        waiting after a preemption the full blocks it left in the prefix cache (admission
        finds them again unless they were evicted meanwhile)."""
        done = request.num_computed_tokens
        if request.status != RequestStatus.RUNNING and self.kv.enable_prefix_caching:
            block_size = self.kv.block_size
            left = min(request.max_computed_tokens, request.num_tokens - 1)
            done = max(done, left // block_size * block_size)
        return done

    def _slo_predicted_ttft(self, request: Request) -> float:
        done = self._slo_done_tokens(request)
        return self.ttft_predictor.predict(request.num_tokens - done, computed_tokens=done)

    def _waiter_views(self) -> tuple[slo.WaiterView, ...]:
        views = []
        for request in self.waiting:
            if len(views) == self._SNAPSHOT_WAITERS:
                break
            if request.request_id in self._slo_holds:
                continue  # held back: it cannot be admitted, so it cannot be the urgent one
            done = self._slo_done_tokens(request)
            views.append(slo.WaiterView(request.request_id, self._ttft_deadline(request),
                                        request.num_tokens - done, done))
        return tuple(views)

    def slo_decide(self, prefills, waiters, now: float,
                   wait_seconds: float) -> tuple[slo.GateDecision, Optional[str]]:
        """The configured gate (also called by the SLO monitor thread: reads config only)."""
        c = self.config
        return slo.evaluate(waiters, prefills, now, self.ttft_predictor, wait_seconds,
                            c.slo_preempt_gate, c.slo_margin_ms / 1000, c.slo_max_preemptions,
                            c.slo_hopeless_tolerance)

    def _slo_between_steps(self, plan: _StepPlan) -> None:
        """Pause the running prefill the gate names for this step, so the urgent waiter can be
        admitted in its place; the victim keeps its blocks and computed tokens."""
        prefills = [self._prefill_view(r) for r in self.running
                    if policy.is_prefilling(r) and r.request_id not in plan.paused]
        if not prefills or not self.waiting:
            return
        predictor = self.ttft_predictor  # the running prefills' backlog, without fixed costs
        backlog = sum(predictor.predict(p.owed_tokens, computed_tokens=p.computed_tokens)
                      - predictor.c for p in prefills)
        decision, waiter_id = self.slo_decide(prefills, self._waiter_views(), plan.now, backlog)
        if not decision.fire:
            return
        victim = self.requests[decision.victim_id]
        victim.num_slo_preemptions += 1
        self.stats.preemptions_by_cause[SLO_BETWEEN_STEPS] += 1
        plan.paused.add(victim.request_id)
        self._slo_holds[victim.request_id] = waiter_id
        plan.slo_waiter, plan.slo_victim = waiter_id, victim.request_id

    def _slo_free_paused_if_memory_blocked(self, plan: _StepPlan) -> None:
        """The pause was not enough when the waiter still waits with budget and seats left:
        blocks are the problem, so this step's victim is preempted (its blocks freed,
        re-queued, still held back) and admission is tried again."""
        waiter = self.requests.get(plan.slo_waiter) if plan.slo_waiter else None
        if waiter is None or waiter.status == RequestStatus.RUNNING or plan.token_budget <= 0:
            return
        if 0 < self.config.max_num_seqs <= len(self.running):
            return
        victim = self.requests.get(plan.slo_victim) if plan.slo_victim else None
        if victim is None or victim.status != RequestStatus.RUNNING:
            return
        self._preempt(victim, plan, SLO_BETWEEN_STEPS, count_cause=False)
        self._schedule_waiting(plan)

    def _slo_make_snapshot(self, output: SchedulerOutput, now: float) -> slo.StepSnapshot:
        counts = output.num_scheduled_tokens
        prefills = tuple(self._prefill_view(r) for r in self.running
                         if counts.get(r.request_id, 0) > 1)
        return slo.StepSnapshot(output.step_id, now, self._predict_step_seconds(output), prefills,
                                self._waiter_views())

    def _predict_step_seconds(self, output: SchedulerOutput) -> float:
        counts = output.num_scheduled_tokens
        if not counts:
            return 0.0
        if self.step_latency_model is None:
            return self.ttft_predictor.predict(output.total_num_scheduled_tokens)
        context = {rid: self.requests[rid].num_computed_tokens for rid in counts}
        return self.step_latency_model.predict(output, context)

    def roll_back_cut_step(self, scheduler_output: SchedulerOutput, victim_id: Optional[str],
                           layers_run: int, num_layers: int,
                           waiter_id: Optional[str] = None) -> None:
        """The step was cut at a layer boundary: call this INSTEAD of update_from_output.

        As if the step never ran: no request's num_computed_tokens advances, nothing is
        sampled, the K/V the step wrote lies past every request's computed tokens (it is never
        read, and is overwritten when those positions are computed again; it was never
        published to the prefix cache). Requests keep the blocks the step gave them. The
        victim is preempted (blocks freed, re-queued); the urgent waiter is admitted next step.
        Step ids are not reused, so a stale cut order can never match a later step.
        """
        self._uncount_chunks(scheduler_output)
        victim = self.requests.get(victim_id) if victim_id is not None else None
        if victim is not None and victim.status == RequestStatus.RUNNING:
            victim.num_slo_preemptions += 1
            self._preempt(victim, _StepPlan(token_budget=0), SLO_MID_STEP)
            if waiter_id is not None:
                self._slo_holds[victim.request_id] = waiter_id
        tokens = scheduler_output.total_num_scheduled_tokens
        self.stats.slo_cut_steps += 1
        self.stats.slo_wasted_layer_tokens += tokens * layers_run
        self.stats.slo_total_layer_tokens += tokens * num_layers

    def _uncount_chunks(self, scheduler_output: SchedulerOutput) -> None:
        """Undo _count_step's chunked-prefill count for a step that did not happen."""
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None and \
                    request.num_computed_tokens + n < request.num_prompt_tokens:
                self.stats.num_chunked_prefill_steps -= 1

    def _count_attainment(self, request: Request, now: float) -> None:
        met = slo.met_deadline(now, request.ttft_deadline)
        if met is not None:
            counts = self.stats.slo_attainment.setdefault(str(request.priority), [0, 0])
            counts[0 if met else 1] += 1

    # ---- checks ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Invariants that hold between steps; tests call this after every step."""
        self.kv.check_integrity()
        waiting = list(self.waiting)
        ids = [r.request_id for r in self.running] + [r.request_id for r in waiting]
        assert len(ids) == len(set(ids)), "a request is both running and waiting, or twice"
        assert set(ids) == set(self.requests), "a request was lost or leaked"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert 0 <= request.num_computed_tokens <= request.num_tokens
        for request in waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if not self.kv.is_swapped(request.request_id):  # a swapped one keeps shared blocks
                assert self.kv.num_held_blocks(request.request_id) == 0, "waiting request holds blocks"
                assert request.num_computed_tokens == 0, "a waiting request kept computed tokens"
        if 0 < self.config.max_num_seqs:
            assert len(self.running) <= self.config.max_num_seqs
