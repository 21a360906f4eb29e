"""The simulator's events and their queue.

An event is a small typed object; the queue orders them by (time, kind, sequence): ties in
time break by kind (arrivals, then KV transfers done, then step ends, then wake-ups, then SLO
monitor polls), then by insertion order, so a run is a pure function of its inputs. Arrivals
first means every request arriving at an instant is queued before a step starting at that
instant is planned; step ends before wake-ups means a wake-up never starts a step on an
instance whose step ends at that same instant before the step end is accounted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    from tokenweir.sim.disagg import Handoff
    from tokenweir.sim.instance import Batch, Instance
    from tokenweir.sim.simulator import Job


class EventKind(IntEnum):
    """Tie-break priority of events at the same time: lower first."""

    ARRIVAL = 0
    TRANSFER_DONE = 1
    STEP_END = 2
    WAKE = 3
    POLL = 4


@dataclass(slots=True)
class Arrival:
    """A user request arrives: the workload's spec number `spec_index`, or a ready `job` (a
    session's later turn)."""

    spec_index: int = -1
    job: Optional[Job] = None


@dataclass(slots=True)
class TransferDone:
    """The KV bytes of a prefill/decode hand-off have crossed the link."""

    handoff: Handoff


@dataclass(slots=True)
class StepEnd:
    """A batch of `instance` completes. Stale (ignored) unless `batch` is still the oldest
    batch in flight there: a mid-step cut replaces the batch and queues an earlier end."""

    instance: Instance
    batch: Batch


@dataclass(slots=True)
class Wake:
    """`instance` may be able to start a batch now."""

    instance: Instance


@dataclass(slots=True)
class Poll:
    """The SLO monitor of `instance` looks at `batch` in flight (its timer, not an arrival).
    Stale (ignored) unless `batch` is still in flight and `chain` is still the cutter's poll
    chain (an arrival restarts the monitor's timer: slo_cuts.SimStepCutter)."""
    instance: Instance
    batch: Batch
    chain: int


Event = Union[Arrival, TransferDone, StepEnd, Wake, Poll]


class EventQueue:
    """A heap of (time, kind, sequence, event). The sequence number makes every key unique,
    so events themselves are never compared."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0

    def push(self, time: float, kind: EventKind, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, kind, self._seq, event))

    def pop(self) -> tuple[float, int, Event]:
        """(time, kind, event) of the first event."""
        time, kind, _, event = heapq.heappop(self._heap)
        return time, kind, event

    def run(self, handlers: list) -> float:
        """Pop every event in order, each to `handlers[kind](event, time)` (which may push
        more), until none is left; returns the last event's time (0.0: none)."""
        heap, pop, now = self._heap, heapq.heappop, 0.0
        while heap:
            now, kind, _, event = pop(heap)
            handlers[kind](event, now)
        return now

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
