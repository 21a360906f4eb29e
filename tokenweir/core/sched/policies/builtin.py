"""The built-in policies other than slo: fcfs and priority orders; fcfs, priority and cost
victims (the choices themselves are pure functions in core/sched/policy.py)."""

from __future__ import annotations

from tokenweir.core.sched.policies.base import SchedulingPolicy, VictimPolicy
from tokenweir.core.sched.queues import PriorityQueue, RequestQueue


class FCFSPolicy(SchedulingPolicy):
    """Arrival order; preempted requests come back at the front."""


class PriorityPolicy(SchedulingPolicy):
    """Lowest `priority` value first, then earliest arrival; victims by priority too."""

    name = "priority"
    default_victim_policy = "priority"

    def make_waiting_queue(self) -> RequestQueue:
        return PriorityQueue()


class FCFSVictim(VictimPolicy):
    """The most recently admitted (the tail of `running`)."""


class PriorityVictim(VictimPolicy):
    """The lowest priority (largest value), then the latest arrival."""

    name = "priority"


class CostVictim(VictimPolicy):
    """The least work lost; a request preempted `max_preemptions` times is immune."""

    name = "cost"
