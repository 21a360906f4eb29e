"""Admission: who leaves the waiting queue this step, and the checks that guard the pool.

In queue order until one does not fit, never on a step that preempted for memory: the
prefix-cache hit, the chunk size (chunked prefill and the partial-prefill cap), the watermark
(only while something runs), the full-sequence check, then the allocation; a swapped-out
request is copied back instead. A policy's veto (`plan.paused` at the head, prefills closed)
stops admission for the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from tokenweir.core.sched.policy import full_sequence_fits, num_tokens_to_schedule
from tokenweir.core.sched.step_plan import PartialPrefills, StepPlan, still_prefilling_after
from tokenweir.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler


def check_pool_fits_one_sequence(kv: KVCacheManager, max_model_len: int) -> None:
    needed = kv.blocks_for_tokens(max_model_len)
    if needed > kv.num_usable_blocks:
        raise ValueError(
            f"the KV pool is too small: one max_model_len={max_model_len} request needs "
            f"{needed} blocks of {kv.block_size} tokens but the pool has "
            f"{kv.num_usable_blocks} usable blocks; raise the pool size "
            f"(num_gpu_blocks_override / kv_cache_space) or lower max_model_len")


def check_budget_fits_one_sequence(config: SchedulerConfig, max_model_len: int) -> None:
    """Without chunked prefill a request is (re)computed in one step: a longer one, or one
    preempted after growing past the budget, could never be scheduled."""
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"with enable_chunked_prefill off, max_num_batched_tokens={budget} must be >= "
            f"max_model_len={max_model_len} (a longer prompt could never be scheduled); "
            f"raise the budget, lower max_model_len, or enable chunked prefill")


class Admission:
    """Moves requests from the scheduler's waiting queue to its `running` list (read from the
    scheduler on each call: the simulator may rebind `running` and `config` around a step)."""

    def __init__(self, sched: "Scheduler") -> None:
        self.sched, self.kv = sched, sched.kv
        self.watermark_blocks = int(sched.config.watermark * sched.kv.num_usable_blocks)

    def admit_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order until one does not fit."""
        sched = self.sched
        waiting, running, max_num_seqs = sched.waiting, sched.running, sched.config.max_num_seqs
        if plan.preempted or not waiting:
            return
        num_partial = PartialPrefills(running, plan)
        reserved = sched.forks.reserved_seats() if max_num_seqs > 0 else 0
        while waiting and plan.token_budget > 0 and not plan.prefills_closed:
            request = waiting.peek()
            seats = num_seats(request)
            if 0 < max_num_seqs < len(running) + reserved + seats:
                break
            if request.request_id in plan.paused:
                break  # vetoed by the policy: it and what sorts after it wait
            admitted = self._try_admit(request, plan, num_partial)
            if admitted is None:
                break
            num_tokens, block_ids = admitted
            waiting.pop()
            if still_prefilling_after(request, num_tokens):
                num_partial.add_one()
            _admit(request, plan.now, running)
            reserved += seats - 1
            plan.add(request, num_tokens, block_ids, is_new=True)
            sched.policy.on_scheduled(sched, request, plan)

    def _try_admit(self, request: Request, plan: StepPlan,
                   num_partial: PartialPrefills) -> Optional[tuple[int, list[int]]]:
        """(tokens this step, new block ids) for the queue head, or None with nothing changed."""
        config = self.sched.config
        reserved = self.watermark_blocks if self.sched.running else 0
        if self.kv.is_swapped(request.request_id):
            return self._try_swap_in(request, plan, num_partial, reserved)
        hits = self.kv.get_computed_blocks(request)
        num_hit_tokens = hits.num_tokens
        num_tokens = self._chunk(request.num_tokens - num_hit_tokens, plan.token_budget,
                                 num_partial)
        if num_tokens == 0:
            return None
        if config.scheduler_reserve_full_isl:
            full_len = min(request.max_num_tokens, self.sched.max_model_len)
            needed = self._blocks_to_reserve(request, full_len, hits)
            if not full_sequence_fits(needed, self.kv.num_free_blocks, reserved):
                return None
        block_ids = self.kv.allocate_slots(request, num_tokens, computed_blocks=hits,
                                           reserved_blocks=reserved)
        if block_ids is None:
            return None
        request.num_computed_tokens = num_hit_tokens
        self.kv.record_admission(request, num_hit_tokens)
        return num_tokens, block_ids

    def _blocks_to_reserve(self, request: Request, full_len: int,
                           hits: ComputedBlocks) -> int:
        """Free blocks the full-sequence check asks for: a parallel-sampling parent not yet
        forked reserves for all its samples at full length (their shared prompt blocks once),
        unless even an empty pool could not hold that; then, as any request, for itself."""
        group = request.group
        single = self.kv.num_blocks_to_admit(full_len, hits)
        if group is None or group.forked:
            return single
        whole = self.kv.num_blocks_to_admit(full_len, hits, group.size - 1,
                                            request.num_prompt_tokens)
        return whole if whole <= self.kv.num_usable_blocks else single

    def _try_swap_in(self, request: Request, plan: StepPlan, num_partial: PartialPrefills,
                     reserved: int) -> Optional[tuple[int, list[int]]]:
        """Re-admit a swapped-out request: copy its blocks back, then room for its next tokens."""
        num_tokens = self._chunk(request.num_tokens - request.num_computed_tokens,
                                 plan.token_budget, num_partial)
        if num_tokens == 0:
            return None
        swap_in = self.kv.readmit_swapped(request, num_tokens, reserved)
        if swap_in is None:
            return None
        plan.swap_in.extend(swap_in.copies)
        self.sched.stats.num_swapped_in += 1
        self.sched.stats.blocks_swapped_in += len(swap_in.copies)
        return num_tokens, swap_in.block_ids

    def _chunk(self, owed: int, token_budget: int, num_partial: PartialPrefills) -> int:
        """Tokens the queue head gets this step out of `owed`, or 0 if it must keep waiting."""
        config = self.sched.config
        if not config.enable_chunked_prefill:
            return owed if owed <= token_budget else 0  # whole or not at all: no threshold
        num_tokens = num_tokens_to_schedule(owed, token_budget,
                                            config.long_prefill_token_threshold)
        if num_tokens < owed and num_partial.value() >= config.max_num_partial_prefills:
            return 0
        return num_tokens


def num_seats(request: Request) -> int:
    """Running seats (max_num_seqs) admitting the request takes: a parallel-sampling parent
    not yet forked takes one per sample, as its samples join `running` when it forks."""
    group = request.group
    return 1 if group is None or group.forked else group.size


def _admit(request: Request, now: float, running: list[Request]) -> None:
    request.status = RequestStatus.RUNNING
    if request.first_scheduled_time is None:
        request.first_scheduled_time = now
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = request.num_computed_tokens
    running.append(request)
