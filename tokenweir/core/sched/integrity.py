"""Invariants that hold between steps; tests call `check_integrity` after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenweir.request import RequestStatus

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler


def check_integrity(sched: "Scheduler") -> None:
    """Blocks conserved (the manager's own check); every request exactly once, running or
    waiting; a waiting request holds no blocks and no computed tokens unless swapped out (a
    swapped one keeps its shared leading blocks); the seat limit kept."""
    sched.kv.check_integrity()
    waiting = list(sched.waiting)
    ids = [r.request_id for r in sched.running] + [r.request_id for r in waiting]
    assert len(ids) == len(set(ids)), "a request is both running and waiting, or twice"
    assert set(ids) == set(sched.requests), "a request was lost or leaked"
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING
        assert 0 <= request.num_computed_tokens <= request.num_tokens
    for request in waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if not sched.kv.is_swapped(request.request_id):
            assert sched.kv.num_held_blocks(request.request_id) == 0, \
                "waiting request holds blocks"
            assert request.num_computed_tokens == 0, "a waiting request kept computed tokens"
    if 0 < sched.config.max_num_seqs:
        assert len(sched.running) + sched.forks.reserved_seats() <= sched.config.max_num_seqs
