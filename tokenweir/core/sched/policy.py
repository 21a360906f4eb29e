"""Pure policy functions: chunk sizing, admission, victim choice, recompute-vs-swap.
No state, no clocks, no torch: time enters only through `PreemptionCosts`, measured rates the
engine hands in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tokenweir.request import Request

RECOMPUTE, SWAP = "recompute", "swap"


@dataclass(frozen=True)
class PreemptionCosts:
    """Rates the engine measures at start-up (or a caller gives): what losing work costs."""

    prefill_seconds_per_token: float = 1e-4
    swap_seconds_per_block: float = 1e-5  # one copy direction, one block, all layers


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """How a victim would be preempted, and the work that would cost, in seconds."""

    action: str  # RECOMPUTE or SWAP
    seconds: float


def num_tokens_to_schedule(owed: int, token_budget: int, long_prefill_token_threshold: int) -> int:
    """Tokens a request gets this step: what it still owes, clamped by the per-request
    threshold (when > 0) and by the budget left. A decode owes exactly 1."""
    if 0 < long_prefill_token_threshold < owed:
        owed = long_prefill_token_threshold
    return min(owed, token_budget)


def is_prefilling(request: Request) -> bool:
    """More than one token owed: the request is (re)building its KV, not decoding."""
    return request.num_tokens - request.num_computed_tokens > 1


def full_sequence_fits(blocks_needed_for_full_sequence: int, num_free_blocks: int,
                       reserved_blocks: int) -> bool:
    """Full-sequence admission: the whole prompt + max_tokens must fit what is free now."""
    return blocks_needed_for_full_sequence <= num_free_blocks - reserved_blocks


def plan_preemption(mode: str, lost_tokens: int, num_blocks: int, can_swap: bool,
                    costs: PreemptionCosts) -> PreemptionPlan:
    """recompute: rebuild `lost_tokens`; swap: copy `num_blocks` out and back (when the host
    pool has room, else recompute); auto: whichever costs less."""
    recompute = PreemptionPlan(RECOMPUTE, lost_tokens * costs.prefill_seconds_per_token)
    if mode == RECOMPUTE or not can_swap:
        return recompute
    swap = PreemptionPlan(SWAP, 2 * num_blocks * costs.swap_seconds_per_block)
    if mode == SWAP or swap.seconds < recompute.seconds:
        return swap
    return recompute


def choose_victim(running: Sequence[Request], requester: Request, policy: str,
                  cost_of: Callable[[Request], float], max_preemptions: int) -> Request:
    """The running request to preempt when blocks run out.

    fcfs: the most recently admitted (the tail of `running`, which is in admission order).
    priority: the lowest priority (largest value), then the latest arrival.
    cost: the least work lost (`cost_of`), then the lowest priority, then the latest arrival;
      a request already preempted `max_preemptions` times is immune, the requester included,
      so nobody starves. When every running request is immune, the requester gives way itself.
    """
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    if policy == "cost":
        candidates = [r for r in running if r.num_preemptions < max_preemptions]
        if not candidates:
            return requester
        return min(candidates, key=lambda r: (cost_of(r), -r.priority, -r.arrival_time))
    return running[-1]
