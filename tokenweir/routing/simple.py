"""Policies that look at no prompt: round-robin, least-loaded, and session affinity."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

from tokenweir.routing.base import UNAVAILABLE, RoutingPolicy, least_loaded


class RoundRobinRouter(RoutingPolicy):
    """The i-th request routed goes to instance i mod n; an unavailable instance is skipped
    (its turn passes to the next available one)."""

    def __init__(self, num_instances: int, block_size: int = 16) -> None:
        super().__init__(num_instances, block_size)
        self._next = 0

    def choose(self, tokens: list[int], loads: Sequence[float],
               session: Optional[Hashable] = None) -> int:
        chosen = self._next
        for _ in range(self.num_instances - 1):
            if loads[chosen] != UNAVAILABLE:
                break
            chosen = (chosen + 1) % self.num_instances
        self._next = (chosen + 1) % self.num_instances
        return chosen


class LeastLoadedRouter(RoutingPolicy):
    """The instance with the least load; ties go to the lowest index."""

    def choose(self, tokens: list[int], loads: Sequence[float],
               session: Optional[Hashable] = None) -> int:
        return least_loaded(loads)


class SessionAffinityRouter(RoutingPolicy):
    """Every request of one session goes where its first went (that instance's prefix cache
    holds the conversation so far); a session's first request, and any request without a
    session, goes to the least loaded instance. A session whose instance became unavailable
    moves to the least loaded one and stays there. Remembers the `capacity` most recently
    used sessions."""

    def __init__(self, num_instances: int, block_size: int = 16,
                 capacity: int = 1 << 16) -> None:
        super().__init__(num_instances, block_size)
        self.capacity = capacity
        self._home: OrderedDict[Hashable, int] = OrderedDict()

    def choose(self, tokens: list[int], loads: Sequence[float],
               session: Optional[Hashable] = None) -> int:
        if session is None:
            return least_loaded(loads)
        home = self._home.get(session)
        if home is None or loads[home] == UNAVAILABLE:
            home = least_loaded(loads)
        self._home[session] = home
        self._home.move_to_end(session)
        if len(self._home) > self.capacity:
            self._home.popitem(last=False)
        return home
