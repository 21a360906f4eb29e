"""Pure policy functions: victim choice, chunk sizing, admission. No state, no time, no torch."""

from __future__ import annotations

from typing import Sequence

from tokenweir.request import Request


def choose_victim(running: Sequence[Request], policy: str) -> Request:
    """The running request to preempt when blocks run out.

    fcfs: the most recently admitted (the tail of `running`, which is in admission order).
    priority: the lowest priority (largest value), then the latest arrival.
    """
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def num_tokens_to_schedule(request: Request, token_budget: int,
                           long_prefill_token_threshold: int) -> int:
    """Tokens a request asks for this step: what it still owes, clamped by the per-request
    threshold (when > 0) and by the budget left. A decode owes exactly 1."""
    owed = request.num_tokens - request.num_computed_tokens
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
