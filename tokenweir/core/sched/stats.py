"""Counting into `SchedulerStats` (core/outputs.py): what each phase adds, in one place."""

from __future__ import annotations

from tokenweir.core.outputs import SchedulerOutput, SchedulerStats
from tokenweir.core.sched.slo import met_deadline
from tokenweir.request import Request


def count_step(stats: SchedulerStats, num_chunked: int, total_tokens: int) -> None:
    stats.num_steps += 1
    stats.last_iteration_tokens = total_tokens
    stats.num_chunked_prefill_steps += num_chunked


def count_recomputed_tokens(stats: SchedulerStats, request: Request, num_tokens: int) -> None:
    """Tokens computed again after a preemption (the recompute tax): the part of this step's
    range that lies below the request's high-water mark, which the range then raises. Call
    before advancing the request."""
    start, high = request.num_computed_tokens, request.max_computed_tokens
    stats.recomputed_tokens += max(0, min(start + num_tokens, high) - start)
    request.max_computed_tokens = max(high, start + num_tokens)


def count_first_token(stats: SchedulerStats, request: Request, now: float) -> None:
    """The request's first token came at `now`: its prompt counts, and so does its TTFT
    deadline's attainment (per priority class) when it has one."""
    stats.prompt_tokens += request.num_prompt_tokens
    met = met_deadline(now, request.ttft_deadline)
    if met is not None:
        counts = stats.slo_attainment.setdefault(str(request.priority), [0, 0])
        counts[0 if met else 1] += 1


def count_cut_step(stats: SchedulerStats, output: SchedulerOutput, layers_run: int,
                   num_layers: int, requests: dict[str, Request]) -> None:
    """A step cut at a layer boundary: its work wasted, and its chunked-prefill count undone
    (call before anything about the step's requests changes)."""
    for request_id, n in output.num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is not None and request.num_computed_tokens + n < request.num_prompt_tokens:
            stats.num_chunked_prefill_steps -= 1
    tokens = output.total_num_scheduled_tokens
    stats.slo_cut_steps += 1
    stats.slo_wasted_layer_tokens += tokens * layers_run
    stats.slo_total_layer_tokens += tokens * num_layers
