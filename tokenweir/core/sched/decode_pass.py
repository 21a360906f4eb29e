"""A step of plain decodes planned and updated in one pass each: the bulk forms of
`Scheduler.schedule` and `update_from_output` for the simulator (issue 36), beside the general
per-request loops in scheduler.py. Each either does exactly what the general path would do, or
changes nothing and returns None / False (the caller then takes the general path). Their checks
and work are whole-step passes in C (map, count, min), so a step costs a few C-level passes
over its requests instead of a Python loop body per request.

Planning (`plan_plain_decodes`): when every running request owes exactly one token, nobody
waits, the running requests fit the token budget, the policy keeps the base class's step hooks
(begin_step, on_scheduled, victim_to_free, end_step: no pause, veto, reorder or victim), no
fork is fresh, no sliding window frees blocks, and the free pool holds a block for every
request whose computed tokens end on a block boundary (so no allocation fails and nobody is
preempted), `schedule(now)` would schedule every running request for one token, in order,
allocating one block (in order) for those on a boundary and admitting nobody: that output is
built here, with the same side effects (allocations, step count, finished and preempted ids
handed over).

Updating (`update_plain_decodes`): a step in which EVERY scheduled request
- is still RUNNING, was scheduled for exactly one token and got exactly one sampled token,
- has never been preempted (no recompute tax to count, no high-water mark to raise),
- gets a token that is none of its EOS ids and leaves it below its `fast_length_cap` (0 before
  its first token: so the token is neither its first nor its last, and no stop rule applies),
and no request's published blocks lag (`has_lagging_registrations`), is updated exactly as
`update_from_output(out, runner_out, now, decoded)` updates it: each computed count + 1, the
blocks that step filled published (in scheduled order), the token appended, the id listed in
`decoded`, the generated tokens counted; no EngineCoreOutput is made (the general path makes
none either for such a step in bulk mode). Any other step changes nothing here and is left to
`update_from_output`.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import add, attrgetter, contains, itemgetter, mod, sub

from typing import Optional

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.policies.base import SchedulingPolicy
from tokenweir.core.sched.stats import count_step
from tokenweir.request import RequestStatus

_status = attrgetter("status")
_preemptions = attrgetter("num_preemptions")
_computed = attrgetter("num_computed_tokens")
_tokens = attrgetter("all_token_ids")
_eos = attrgetter("eos_token_ids")
_cap = attrgetter("fast_length_cap")
_rid = attrgetter("request_id")
_first = itemgetter(0)
_STEP_HOOKS = ("begin_step", "on_scheduled", "victim_to_free", "end_step")


def plan_plain_decodes(sched, now: float) -> Optional[SchedulerOutput]:
    """`sched.schedule(now)`'s output when the module's planning contract holds (made here, in
    one pass), else None with nothing changed. (`now` would only stamp admissions: none.)"""
    running, kv = sched.running, sched.kv
    n = len(running)
    if not n or n > sched.config.max_num_batched_tokens or len(sched.waiting) \
            or not _keeps_base_hooks(sched.policy) or kv.sliding_window is not None \
            or kv.fresh_forks():
        return None
    computed = list(map(_computed, running))
    if list(map(sub, map(len, map(_tokens, running)), computed)).count(1) != n:
        return None  # someone prefills (or owes nothing)
    on_boundary = _offsets_in_block(computed, kv.block_size)  # 0: needs a block
    num_boundary = on_boundary.count(0)
    if num_boundary > kv.num_free_blocks:
        return None
    new_block_ids, allocate, i = {}, kv.allocate_slots, -1
    for _ in range(num_boundary):  # in running order, as the running pass allocates
        i = on_boundary.index(0, i + 1)
        request = running[i]
        block_ids = allocate(request, 1)
        assert block_ids is not None  # a free block each (held >= cdiv(computed))
        new_block_ids[request.request_id] = block_ids
    ids = list(map(_rid, running))
    stats = sched.stats
    count_step(stats, 0, n)
    finished, sched._finished_since_last_step = sched._finished_since_last_step, set()
    return SchedulerOutput(
        scheduled_new_reqs=[], num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=n, cached_req_ids=ids, cached_num_computed_tokens=computed,
        new_block_ids=new_block_ids, preempted_req_ids=sched.preemption.take_preempted_ids(),
        finished_req_ids=finished, step_id=stats.num_steps, blocks_to_swap_in=[],
        blocks_to_swap_out=[], blocks_to_copy=[], scheduled_requests=list(running))


def _offsets_in_block(computed: list[int], block_size: int) -> list[int]:
    """Each request's computed tokens modulo the block size: 0 where its next token starts a
    new block."""
    return list(map(mod, computed, repeat(block_size)))


def _keeps_base_hooks(policy) -> bool:
    """The policy's class overrides none of the step hooks (fcfs and priority do not);
    answered once per class."""
    cls = type(policy)
    keeps = _KEEPS_BASE_HOOKS.get(cls)
    if keeps is None:
        keeps = _KEEPS_BASE_HOOKS[cls] = all(
            getattr(cls, hook) is getattr(SchedulingPolicy, hook) for hook in _STEP_HOOKS)
    return keeps


_KEEPS_BASE_HOOKS: dict[type, bool] = {}


def update_plain_decodes(sched, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                         decoded: list[str]) -> bool:
    """Update `sched` for the step `out` in one pass when the module's contract holds (True);
    otherwise change nothing (False)."""
    reqs = out.scheduled_requests
    if reqs is None or runner_out.logprobs or sched.kv.has_lagging_registrations():
        return False
    n = len(reqs)
    if not n:
        return False
    # every count is >= 1 (SchedulerOutput's contract): a total of n means one token each
    if out.total_num_scheduled_tokens != n or len(out.num_scheduled_tokens) != n:
        return False
    if list(map(_status, reqs)).count(RequestStatus.RUNNING) != n \
            or any(map(_preemptions, reqs)):
        return False
    ids = list(map(_rid, reqs))
    samples = list(map(runner_out.sampled_token_ids.get, ids))
    if None in samples or list(map(len, samples)).count(1) != n:
        return False
    token_ids = list(map(_first, samples))
    token_lists = list(map(_tokens, reqs))
    if any(map(contains, map(_eos, reqs), token_ids)) \
            or min(map(sub, map(_cap, reqs), map(len, token_lists))) <= 1:
        return False  # an EOS, a first token (cap 0) or the last one below the length cap
    _advance(sched, reqs, token_lists, token_ids)
    decoded.extend(ids)
    sched.stats.generation_tokens += n
    return True


def _advance(sched, reqs: list, token_lists: list, token_ids: list) -> None:
    """Each request's computed count + 1, filled blocks published, its token appended."""
    computed = list(map(add, map(_computed, reqs), repeat(1)))
    deque(map(setattr, reqs, repeat("num_computed_tokens"), computed), 0)
    kv = sched.kv
    if kv.enable_prefix_caching:
        filled = list(map(mod, computed, repeat(kv.block_size)))  # 0: the step filled a block
        register, i = kv.register_computed_blocks, -1
        for _ in range(filled.count(0)):
            i = filled.index(0, i + 1)
            register(reqs[i])
    deque(map(list.append, token_lists, token_ids), 0)
