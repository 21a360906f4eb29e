"""Preemption: recompute / swap / auto, applied to the victim a victim policy names.

A victim goes back to the front of the waiting queue with its output tokens kept, and either
loses its KV (recompute: blocks freed, `num_computed_tokens` reset to 0) or has it copied to a
host pool (swap: resumes where it stopped once copied back). Only memory preemptions may swap
and stop admissions for the step; a policy's pause or cut (SLO_* causes) always recomputes
(prefix caching keeps its full blocks findable) and does not stop admissions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tokenweir.core.outputs import MEMORY
from tokenweir.core.sched.policy import SWAP, PreemptionPlan, plan_preemption
from tokenweir.core.sched.step_plan import StepPlan
from tokenweir.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler


class Preemption:
    """Moves requests from the scheduler's `running` list back to its waiting queue (both
    read from the scheduler on each call: the simulator may rebind `running` and `config`
    around a step), as are the costs (measured ones may replace the defaults)."""

    def __init__(self, sched: "Scheduler") -> None:
        self.sched, self.kv = sched, sched.kv
        self.preempted_ids: set[str] = set()  # since the last step's output

    def allocate_or_preempt(self, request: Request, num_tokens: int, plan: StepPlan,
                            fork: bool = False) -> Optional[list[int]]:
        """Room for the running `request`'s next `num_tokens`, preempting victims until it
        fits; None when the request itself was preempted. `fork`: the request is a fresh fork
        (parallel sampling): its copy-on-write goes into the plan and its whole block table is
        returned (the runner first meets it in this step)."""
        while True:
            block_ids = (self._allocate_fork(request, num_tokens, plan) if fork
                         else self.kv.allocate_slots(request, num_tokens))
            if block_ids is not None:
                return block_ids
            victim = self.sched.victim_policy.choose(self.sched.running, request,
                                                     lambda r: self.plan_for(r).seconds)
            self.preempt(victim, plan)
            if victim is request:
                return None

    def _allocate_fork(self, request: Request, num_tokens: int,
                       plan: StepPlan) -> Optional[list[int]]:
        slots = self.kv.allocate_fork_slots(request, num_tokens)
        if slots is None:
            return None
        if slots.copies:
            plan.copies[request.request_id] = slots.copies
        return slots.block_ids

    def plan_for(self, request: Request) -> PreemptionPlan:
        """Swap or recompute, and what it costs; prefix-cache blocks shared with other holders
        survive a recompute and are not counted as lost."""
        footprint = self.kv.preemption_footprint(request)
        return plan_preemption(self.sched.config.preemption_mode, footprint.lost_tokens,
                               footprint.swappable_blocks, footprint.can_swap, self.sched.costs)

    def preempt(self, request: Request, plan: StepPlan, cause: str = MEMORY,
                count_cause: bool = True) -> None:
        """Send a running request back to the waiting queue."""
        stats = self.sched.stats
        if not request.num_preemptions and \
                request.num_computed_tokens > request.num_cached_tokens:
            # The update skips the high-water mark of a request never preempted: once a step
            # has computed its tokens (beyond its admission's hits) it is num_computed_tokens.
            request.max_computed_tokens = request.num_computed_tokens
        self.sched.running.remove(request)
        # A fork that copied a block this step is recomputed: its copy is dropped with it.
        copied = request.request_id in plan.copies
        plan.drop(request)
        if cause == MEMORY and not copied and self.plan_for(request).action == SWAP:
            pairs = self.kv.swap_out(request)
            plan.swap_out.extend(pairs)
            stats.num_swapped_out += 1
            stats.blocks_swapped_out += len(pairs)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        stats.num_preemptions += 1
        if count_cause:
            stats.preemptions_by_cause[cause] += 1
        self.sched.waiting.prepend(request)
        if cause == MEMORY:
            plan.preempted.append(request)
        self.preempted_ids.add(request.request_id)

    def take_preempted_ids(self) -> set[str]:
        ids, self.preempted_ids = self.preempted_ids, set()
        return ids
