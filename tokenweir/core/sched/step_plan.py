"""The budget and what one step schedules: a `StepPlan` is filled by the running pass and by
admission, undone for a request preempted later in the same step, and becomes the step's
`SchedulerOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Optional

from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import NewRequestData, SchedulerOutput
from tokenweir.core.sched.policy import is_prefilling
from tokenweir.request import Request


@dataclass(slots=True, init=False)
class StepPlan:
    """What one schedule() call has decided so far.

    `paused` and `prefills_closed` are how a policy vetoes for one step (see
    policies/base.py): a paused running request gets no tokens, and a paused waiting request at
    the head of the queue stops admission; with prefills closed, no further prefill (running or
    waiting) joins the step. A policy may lower `token_budget` before the running pass.
    Made once per step of every instance: `__init__` is written out (empty containers as
    literals), a third of the opcodes of the generated one with its default factories.
    """

    token_budget: int
    now: float = 0.0
    num_scheduled: dict[str, int] = field(default_factory=dict)
    scheduled: list[Request] = field(default_factory=list)  # in num_scheduled's order
    new_reqs: list[Request] = field(default_factory=list)
    # The running requests scheduled, in order, and their computed tokens before this step:
    # the output's `cached_req_ids` / `cached_num_computed_tokens`, built as they are added.
    cached_req_ids: list[str] = field(default_factory=list)
    cached_num_computed: list[int] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_chunked: int = 0  # scheduled prefill chunks that stop short of their prompt's end
    preempted: list[Request] = field(default_factory=list)  # for memory: admits nobody new
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # forks' copy-on-write
    paused: set[str] = field(default_factory=set)
    prefills_closed: bool = False

    def __init__(self, token_budget: int, now: float = 0.0) -> None:
        self.token_budget, self.now = token_budget, now
        self.num_scheduled, self.scheduled, self.new_reqs = {}, [], []
        self.cached_req_ids, self.cached_num_computed, self.new_block_ids = [], [], {}
        self.num_chunked, self.preempted, self.swap_in, self.swap_out = 0, [], [], []
        self.copies, self.paused, self.prefills_closed = {}, set(), False

    def add(self, request: Request, num_tokens: int, block_ids: list[int], is_new: bool) -> None:
        rid = request.request_id
        self.num_scheduled[rid] = num_tokens
        self.scheduled.append(request)
        self.new_block_ids[rid] = block_ids
        if is_new:
            self.new_reqs.append(request)
        else:
            self.cached_req_ids.append(rid)
            self.cached_num_computed.append(request.num_computed_tokens)
        if stops_short_of_prompt(request, num_tokens):
            self.num_chunked += 1
        self.token_budget -= num_tokens

    def add_hot_decodes(self, running: list[Request], i: int, block_size: int) -> int:
        """The scheduler's running pass, hot case, where no set can exclude a decode: from
        `running[i]` on, each decode (owes 1 token; the budget is > 0) whose computed tokens
        end inside a block (room for its next one) is added as `add` would add it, with no
        new blocks listed. Returns the index of the first request that is not such a decode
        (or len(running)). The run goes into `scheduled` and `num_scheduled` at once, in
        order (nothing else adds meanwhile)."""
        ids, computeds = self.cached_req_ids, self.cached_num_computed
        before = len(ids)
        for request in islice(running, i, i + self.token_budget):
            computed = request.num_computed_tokens
            if len(request.all_token_ids) - computed != 1 or not computed % block_size:
                break
            ids.append(request.request_id)
            computeds.append(computed)
        n = len(ids) - before
        if n:
            self.scheduled.extend(running[i:i + n])
            self.num_scheduled.update(dict.fromkeys(ids[before:], 1))
            self.token_budget -= n
        return i + n

    def to_output(self, kv: KVCacheManager, total_tokens: int, step_id: int,
                  preempted_ids: set[str], finished_ids: set[str]) -> SchedulerOutput:
        """The step as the runner sees it; new requests in full (every block they hold), the
        running ones as diffs (their CachedRequestData is built when read)."""
        new_reqs = [NewRequestData(
            req_id=r.request_id, token_ids=list(r.all_token_ids),
            num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.sampling_params,
            block_ids=kv.block_ids(r.request_id), num_computed_tokens=r.num_computed_tokens,
        ) for r in self.new_reqs]
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs, num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=total_tokens, cached_req_ids=self.cached_req_ids,
            cached_num_computed_tokens=self.cached_num_computed,
            new_block_ids=self.new_block_ids, preempted_req_ids=preempted_ids,
            finished_req_ids=finished_ids, step_id=step_id,
            blocks_to_swap_in=self.swap_in, blocks_to_swap_out=self.swap_out,
            blocks_to_copy=[pair for pairs in self.copies.values() for pair in pairs],
            scheduled_requests=self.scheduled)

    def drop(self, request: Request) -> None:
        """Undo `add` for a request preempted later in the same step."""
        rid = request.request_id
        num_tokens = self.num_scheduled.pop(rid, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.scheduled.remove(request)
        self.new_block_ids.pop(rid, None)
        self.copies.pop(rid, None)  # its blocks went back: nothing to copy into them
        if stops_short_of_prompt(request, num_tokens):
            self.num_chunked -= 1
        if request in self.new_reqs:
            self.new_reqs.remove(request)
        else:
            k = self.cached_req_ids.index(rid)
            del self.cached_req_ids[k], self.cached_num_computed[k]


def scheduled_pairs(out: SchedulerOutput, requests: dict[str, Request]):
    """(request, tokens) for each entry of `out.num_scheduled_tokens`, in its order: the
    output's own `scheduled_requests`, or (an output without them) by id among `requests`,
    skipping ids no longer there."""
    counts = out.num_scheduled_tokens
    if out.scheduled_requests is not None:
        return zip(out.scheduled_requests, counts.values())
    return [(requests[rid], n) for rid, n in counts.items() if rid in requests]


def stops_short_of_prompt(request: Request, num_tokens: int) -> bool:
    """A chunk of `num_tokens` from the request's computed tokens ends inside its prompt (a
    chunked prefill step). Never true of a decode: it owes 1 token, the last it knows."""
    return request.num_computed_tokens + num_tokens < len(request.prompt_token_ids)


class PartialPrefills:
    """How many requests will be mid-prefill when this step ends: the running ones (paused ones
    excluded) whose prefill this step's chunk does not finish, plus the admissions this step
    that got only part of their prompt. A request whose last chunk runs in this step is not
    counted, so the step's remaining budget may start the next prompt (it would otherwise go
    unused whenever the cap is reached). Only an admission that would itself be chunked asks,
    so the pass over `running` is made on the first ask, not on every step with a waiting
    request. Admissions append to `running`, and nothing else changes it while admitting, so
    its first `len` entries stay the ones that were running."""

    __slots__ = ("_running", "_paused", "_scheduled", "_num_running", "_counted", "_admitted")

    def __init__(self, running: list[Request], plan: StepPlan) -> None:
        self._running, self._num_running = running, len(running)
        self._paused, self._scheduled = plan.paused, plan.num_scheduled
        self._counted: Optional[int] = None
        self._admitted = 0

    def value(self) -> int:
        if self._counted is None:
            scheduled = self._scheduled
            self._counted = sum(
                1 for r in self._running[:self._num_running]
                if r.request_id not in self._paused
                and still_prefilling_after(r, scheduled.get(r.request_id, 0)))
        return self._counted + self._admitted

    def add_one(self) -> None:
        self._admitted += 1


def still_prefilling_after(request: Request, num_tokens: int) -> bool:
    """The request is prefilling and a chunk of `num_tokens` (0: not scheduled) does not
    finish it."""
    return is_prefilling(request) and \
        request.num_computed_tokens + num_tokens < request.num_tokens
