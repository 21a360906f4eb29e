"""`max_computed_tokens` is no longer written on every update of a request never preempted
(issue 36: a write per decoded token); preemption sets it instead. Every decision and count
must come out as with the per-update write, in the random run that has every feature on
(recompute and swap preemption, slo pauses and cuts, which read the mark, prefix caching)."""

from __future__ import annotations

import dataclasses

from tests.core import random_run as rr
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.core.sched.step_plan import scheduled_pairs
from tokenweir.request import RequestStatus

STEPS = 6000


def _run(monkeypatch, write_every_update: bool):
    """The random run; with `write_every_update`, the update writes the mark as it used to."""
    if write_every_update:
        update = Scheduler.update_from_output

        def writing_update(self, out, runner_out, now=0.0, decoded=None):
            running = [r for r, _ in scheduled_pairs(out, self.requests)
                       if r.status is RequestStatus.RUNNING and not r.num_preemptions]
            outputs = update(self, out, runner_out, now, decoded)
            for request in running:
                request.max_computed_tokens = request.num_computed_tokens
            return outputs

        monkeypatch.setattr(Scheduler, "update_from_output", writing_update)
    marks: dict[str, int] = {}
    check_end = rr.Segment.check_end

    def keeping_marks(segment):
        marks.update({rid: r.max_computed_tokens for rid, r in segment.added.items()
                      if r.num_preemptions})
        check_end(segment)

    monkeypatch.setattr(rr.Segment, "check_end", keeping_marks)
    stats = rr.random_run(STEPS, seed=3, steps_per_segment=STEPS // 2)
    monkeypatch.undo()
    return dataclasses.asdict(stats), marks


def test_preemption_sets_the_mark_the_update_no_longer_writes(monkeypatch):
    stats, marks = _run(monkeypatch, write_every_update=False)
    reference, reference_marks = _run(monkeypatch, write_every_update=True)
    assert stats == reference
    assert marks == reference_marks
    # probes: preemptions of both kinds, recomputed tokens (counted against the mark), and
    # the slo policy's pauses and cuts (it reads the mark of a preempted request) happened
    counts = stats["counters"]
    assert counts["preemptions"] > 50 and counts["swapped_out"] > 0
    assert counts["recomputed_tokens"] > 50
    assert counts["slo_pauses"] > 0 and counts["slo_cuts"] > 0
    assert sum(1 for m in marks.values() if m > 0) > 20
