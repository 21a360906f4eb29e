"""Preemption: recompute / swap / auto, applied to the victim a victim policy names.

A victim goes back to the front of the waiting queue with its output tokens kept, and either
loses its KV (recompute: blocks freed, `num_computed_tokens` reset to 0) or has it copied to a
host pool (swap: resumes where it stopped once copied back). Only memory preemptions may swap
and stop admissions for the step; a policy's pause or cut (SLO_* causes) always recomputes
(prefix caching keeps its full blocks findable) and does not stop admissions.
"""

from __future__ import annotations

from typing import Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import MEMORY, SchedulerStats
from tokenweir.core.sched.policies import VictimPolicy
from tokenweir.core.sched.policy import SWAP, PreemptionCosts, PreemptionPlan, plan_preemption
from tokenweir.core.sched.queues import RequestQueue
from tokenweir.core.sched.step_plan import StepPlan
from tokenweir.request import Request, RequestStatus


class Preemption:
    """Shares the scheduler's `running` list and waiting queue (mutating them in place) and its
    stats; `costs` may be replaced once measured."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, costs: PreemptionCosts,
                 victim_policy: VictimPolicy, running: list[Request], waiting: RequestQueue,
                 stats: SchedulerStats) -> None:
        self.config, self.kv, self.costs, self.victim_policy = config, kv, costs, victim_policy
        self.running, self.waiting, self.stats = running, waiting, stats
        self.preempted_ids: set[str] = set()  # since the last step's output

    def allocate_or_preempt(self, request: Request, num_tokens: int,
                            plan: StepPlan) -> Optional[list[int]]:
        """Room for the running `request`'s next `num_tokens`, preempting victims until it
        fits; None when the request itself was preempted."""
        while True:
            block_ids = self.kv.allocate_slots(request, num_tokens)
            if block_ids is not None:
                return block_ids
            victim = self.victim_policy.choose(self.running, request,
                                               lambda r: self.plan_for(r).seconds)
            self.preempt(victim, plan)
            if victim is request:
                return None

    def plan_for(self, request: Request) -> PreemptionPlan:
        """Swap or recompute, and what it costs; prefix-cache blocks shared with other holders
        survive a recompute and are not counted as lost."""
        footprint = self.kv.preemption_footprint(request)
        return plan_preemption(self.config.preemption_mode, footprint.lost_tokens,
                               footprint.swappable_blocks, footprint.can_swap, self.costs)

    def preempt(self, request: Request, plan: StepPlan, cause: str = MEMORY,
                count_cause: bool = True) -> None:
        """Send a running request back to the waiting queue."""
        self.running.remove(request)
        plan.drop(request)
        if cause == MEMORY and self.plan_for(request).action == SWAP:
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
        self.preempted_ids.add(request.request_id)

    def take_preempted_ids(self) -> set[str]:
        ids, self.preempted_ids = self.preempted_ids, set()
        return ids
