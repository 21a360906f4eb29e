"""The replicas behind the router: each one's health, reported load and requests in flight.

Health: every `health_interval` seconds each replica's GET /health must answer 200 within
`health_timeout`; then its GET /metrics gives its load. A replica that fails a check (or a
request to it fails to connect) is taken out: its in-flight requests are ended at once (see
flight.py), and no request is routed to it until a check succeeds again.

Load (what the routing policy compares, lower is less loaded): the requests on the replica,
counted as the larger of what the router has in flight there (exact, and current) and the
running + waiting the replica last reported (which also sees other clients), plus its KV-cache
usage in [0, 1] (so equal counts go to the emptier cache). A replica that is out has load
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Hashable, Optional

import httpx

from tokenweir.routing import UNAVAILABLE, RoutingPolicy

logger = logging.getLogger("tokenweir.router")

_GAUGES = {"tokenweir:num_requests_running": "running",
           "tokenweir:num_requests_waiting": "waiting",
           "tokenweir:kv_cache_usage_perc": "kv_usage"}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")


@dataclass(eq=False)
class Replica:
    index: int
    url: str
    up: bool = False
    running: float = 0.0  # as last reported on /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0
    flights: set = field(default_factory=set)  # flight.Flight objects in flight here
    last_error: Optional[str] = None
    routed: int = 0  # requests the policy chose this replica for
    failed: int = 0  # requests that ended with an error because this replica failed
    taken_out: int = 0  # times it was taken out

    def load(self) -> float:
        if not self.up:
            return UNAVAILABLE
        return max(len(self.flights), self.running + self.waiting) + min(self.kv_usage, 1.0)


def parse_load(text: str) -> dict[str, float]:
    """running / waiting / kv_usage from a replica's Prometheus text (summed over labels)."""
    found = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in _GAUGES:
            found[_GAUGES[match.group(1)]] += float(match.group(2))
    return found


class ReplicaSet:
    def __init__(self, urls: list[str], policy: RoutingPolicy, health_interval: float,
                 health_timeout: float) -> None:
        self.replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.policy = policy
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self._client: Optional[httpx.AsyncClient] = None

    # ---- routing -----------------------------------------------------------------------------
    def choose(self, tokens: list[int], session: Optional[Hashable],
               exclude: frozenset[int] = frozenset()) -> Optional[Replica]:
        """The replica the policy picks among those up and not in `exclude`; None if none."""
        loads = [UNAVAILABLE if r.index in exclude else r.load() for r in self.replicas]
        if all(load == UNAVAILABLE for load in loads):
            return None
        chosen = self.replicas[self.policy.choose(tokens, loads, session)]
        if loads[chosen.index] == UNAVAILABLE:
            raise RuntimeError(f"routing policy {type(self.policy).__name__} chose replica "
                               f"{chosen.url}, which is unavailable (routing/base.py)")
        chosen.routed += 1
        return chosen

    def any_up(self) -> Optional[Replica]:
        return next((r for r in self.replicas if r.up), None)

    def take_out(self, replica: Replica, reason: str) -> None:
        """No more requests to `replica` until a health check passes; end its flights."""
        if replica.up:
            logger.warning("replica %s taken out: %s", replica.url, reason)
            replica.taken_out += 1
        replica.up, replica.last_error = False, reason
        for flight in list(replica.flights):
            flight.fail(reason)

    # ---- health ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.health_timeout, trust_env=False)
        await self.check_all()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def run_health_checks(self) -> None:
        """Forever: sleep `health_interval`, check every replica (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def check(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.health_timeout):
                health = await self._client.get(replica.url + "/health")
                if health.status_code != 200:
                    raise RuntimeError(f"/health answered {health.status_code}")
                metrics = await self._client.get(replica.url + "/metrics")
        except TimeoutError:
            self.take_out(replica, f"no answer to a health check in {self.health_timeout} s")
            return
        except (httpx.HTTPError, RuntimeError) as exc:
            self.take_out(replica, f"health check failed: {describe(exc)}")
            return
        if metrics.status_code == 200:
            for name, value in parse_load(metrics.text).items():
                setattr(replica, name, value)
        if not replica.up:
            logger.info("replica %s is up", replica.url)
        replica.up, replica.last_error = True, None


def describe(exc: BaseException) -> str:
    """A one-line account of a failed exchange (httpx's messages can be empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
