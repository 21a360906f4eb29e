"""Parallel sampling in the scheduler: the samples of one request (request.SampleGroup).

The parent is admitted and prefilled like any request; the step that samples its first token
forks the other samples in the scheduler's update (`fork`): they join `running` after it,
share its KV blocks (kv_cache_manager.py: `fork`) and owe the prompt's last token, whose
logits give each its own first token. From then on each sample is an ordinary running request
(its own preemption, stop rules and finish); the group's output is assembled above the
scheduler (engine/output_processor.py). Until its parent forks, a group holds a running seat
(max_num_seqs) per sample, and a parent that finishes unforked (abort, error) takes its other
samples with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenweir.core.sched.stop import fast_length_cap
from tokenweir.request import Request, RequestStatus, SampleGroup

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler


class Forks:
    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched
        self.unforked_parents: dict[str, Request] = {}  # by id, in the scheduler, not forked

    def add(self, request: Request) -> None:
        """A request enters the scheduler: for a group's parent, ValueError if its samples could
        never run together."""
        group, max_num_seqs = request.group, self.sched.config.max_num_seqs
        if group is None:
            return
        assert group.parent is request and not group.forked, "only a parent is added"
        if 0 < max_num_seqs < group.size:
            raise ValueError(f"request {request.request_id}: {group.size} samples (n / best_of) "
                             f"exceed max_num_seqs={max_num_seqs}")
        self.unforked_parents[request.request_id] = request

    def reserved_seats(self) -> int:
        """Running seats promised to the samples of running parents that have not forked."""
        if not self.unforked_parents:
            return 0
        return sum(r.group.size - 1 for r in self.unforked_parents.values()
                   if r.status == RequestStatus.RUNNING)

    def first_token(self, request: Request, now: float) -> None:
        """`request` just sampled its first token: a group's parent forks."""
        if request.group is not None and not request.group.forked:
            self.fork(request.group, now)

    def fork(self, group: SampleGroup, now: float) -> None:
        """The parent sampled its first token (its prompt is computed): the other samples join
        `running` after it, each sharing its blocks and owing the prompt's last token. Each of
        them, parent included, is a fresh fork until its next allocation."""
        sched, parent = self.sched, group.parent
        group.forked = True
        del self.unforked_parents[parent.request_id]
        children = group.samples[1:]
        for sample in children:
            sample.num_computed_tokens = sample.max_computed_tokens = parent.num_prompt_tokens - 1
            sample.status = RequestStatus.RUNNING
            sample.first_scheduled_time, sample.first_token_time = parent.first_scheduled_time, now
            sample.num_cached_tokens = parent.num_cached_tokens
        sched.kv.fork(parent, children)
        for sample in children:
            sched.requests[sample.request_id] = sample
            sample.fast_length_cap = fast_length_cap(sample)
            sched.running.append(sample)

    def finished(self, request: Request, status: RequestStatus, finished_ids: set[str]) -> None:
        """`request`, a sample, just finished with `status`: if it is a parent that never
        forked, so do its other samples (they hold nothing; their ids go to `finished_ids`,
        which reach the runner)."""
        group = request.group
        if group is None or group.forked:
            return
        self.unforked_parents.pop(request.request_id, None)
        for sample in group.samples[1:]:
            sample.status, sample.error = status, request.error
            sample.finished_time = request.finished_time
            finished_ids.add(sample.request_id)
