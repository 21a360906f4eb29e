"""Waiting queues behind one interface: FCFS, priority and deadline (slo).

Contract: `peek()`/`pop()` give the request to admit next; `prepend()` puts a preempted request
where it will be admitted before anything that was waiting behind it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Iterator

from tokenweir.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a preempted request ahead of those that waited behind it."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit; IndexError when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return `peek()`."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a request wherever it is (abort); ValueError if absent."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class KeyedQueue(RequestQueue):
    """A heap in the order of `key(request)` (smallest first), ties by insertion. Subclasses
    give only `key`; a preempted request keeps its key, so it comes back ahead of every later
    arrival with a larger one. This is the queue to subclass for a user's own order."""

    def key(self, request: Request) -> tuple:
        raise NotImplementedError

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), next(self._seq), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


class PriorityQueue(KeyedQueue):
    """Lowest `priority` value first (vLLM's convention), then earliest arrival.

    A preempted request keeps its key, so it comes back ahead of every later arrival of its
    priority: that is what "front of the queue" means under priority scheduling.
    """

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


class DeadlineQueue(RequestQueue):
    """The "slo" order: urgency changes with time, so the scheduler calls `reorder(key)` with
    the current EDF key (larger first) before reading the queue; between reorders requests
    stay in that order, new arrivals at the back. Ties keep arrival order (a stable sort).

    A preempted request is re-enqueued like a new one: its deadline, not its history, places it.
    """

    def __init__(self) -> None:
        self._items: list[Request] = []

    def add(self, request: Request) -> None:
        self._items.append(request)

    prepend = add

    def reorder(self, key: Callable[[Request], float]) -> None:
        self._items.sort(key=lambda r: (-key(r), r.arrival_time))

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item is request:
                del self._items[i]
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "slo":
        return DeadlineQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
