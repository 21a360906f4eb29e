"""GET /metrics of the router: every replica's own metrics, each sample labelled with
`replica` (its URL), followed by the router's: whether each replica is up, its load, the
requests in flight there, routed there, and failed with it, and how many requests moved to a
second replica. A replica that does not answer within the health timeout is left out of that
scrape (its `tokenweir:router_replica_up` says 0)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from tokenweir.router.replicas import Replica, ReplicaSet

ROUTER_PREFIX = "tokenweir:router_"


async def scrape(client: httpx.AsyncClient, replicas: ReplicaSet, retries: int) -> bytes:
    """The exposition text of the whole deployment (`retries`: requests moved so far)."""
    texts = await asyncio.gather(*(_scrape_one(client, r, replicas.health_timeout)
                                   for r in replicas.replicas))
    return exposition(((r.url, t) for r, t in zip(replicas.replicas, texts) if t),
                      replicas.replicas, retries)


def exposition(texts: Iterable[tuple[str, str]], replicas: list[Replica],
               retries: int) -> bytes:
    """The replicas' (url, text) pairs merged, then the router's families, as exposition
    text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*merge_families(texts), *router_families(replicas, retries)]))
    return generate_latest(registry)


async def _scrape_one(client: httpx.AsyncClient, replica: Replica,
                      timeout: float) -> Optional[str]:
    if not replica.up:
        return None
    try:
        response = await client.get(replica.url + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def merge_families(texts: Iterable[tuple[str, str]]) -> list[Metric]:
    """One family per name over every replica's text, each sample with `replica` added (the
    first replica's help and type stand for the family)."""
    merged: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation,
                                                    family.type, family.unit)
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "replica": replica},
                                sample.value, sample.timestamp, sample.exemplar)
    return list(merged.values())


@dataclass(frozen=True)
class RouterFamily:
    """One of the router's per-replica families: `tokenweir:router_<name>`, a `kind`
    ("gauge" or "counter"; a counter's samples are exposed as `<name>_total`), and the value
    it reads from a replica."""
    name: str
    kind: str
    help: str
    value: Callable[[Replica], float]


ROUTER_FAMILIES = (
    RouterFamily("replica_up", "gauge", "1 while the replica takes requests.",
                 lambda r: 1.0 if r.up else 0.0),
    RouterFamily("replica_load", "gauge",
                 "The load the routing policy sees (requests + KV usage).",
                 lambda r: r.load() if r.up else 0.0),
    RouterFamily("in_flight", "gauge", "Requests the router has in flight on the replica.",
                 lambda r: len(r.flights)),
    RouterFamily("routed", "counter", "Requests the routing policy sent to the replica.",
                 lambda r: r.routed),
    RouterFamily("failed", "counter",
                 "Requests that ended with an error because the replica failed.",
                 lambda r: r.failed),
    RouterFamily("taken_out", "counter", "Times the replica was taken out of routing.",
                 lambda r: r.taken_out),
)
_KINDS = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def router_families(replicas: list[Replica], retries: int) -> list[Metric]:
    """ROUTER_FAMILIES with a sample per replica (labelled with its URL), in the table's
    order, then the deployment-wide count of requests moved to a second replica."""
    families = []
    for spec in ROUTER_FAMILIES:
        family = _KINDS[spec.kind](ROUTER_PREFIX + spec.name, spec.help, labels=["replica"])
        for r in replicas:
            family.add_metric([r.url], spec.value(r))
        families.append(family)
    moved = CounterMetricFamily(ROUTER_PREFIX + "retries",
                                "Requests moved to a second replica before any byte was sent.")
    moved.add_metric([], retries)
    return [*families, moved]


class _Fixed:
    """A collector that yields the families it was built with (one scrape's worth)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
