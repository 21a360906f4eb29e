"""GET /metrics of the router: every replica's own metrics, each sample labelled with
`replica` (its URL), followed by the router's: whether each replica is up, its load, the
requests in flight there, routed there, and failed with it, and how many requests moved to a
second replica. A replica that does not answer within the health timeout is left out of that
scrape (its `tokenweir:router_replica_up` says 0)."""

from __future__ import annotations

import asyncio
from typing import Iterable, Optional

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
    families = merge_families((r.url, t) for r, t in zip(replicas.replicas, texts) if t)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families, *router_families(replicas.replicas, retries)]))
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


def router_families(replicas: list[Replica], retries: int) -> list[Metric]:
    up = GaugeMetricFamily(ROUTER_PREFIX + "replica_up", "1 while the replica takes requests.",
                           labels=["replica"])
    load = GaugeMetricFamily(ROUTER_PREFIX + "replica_load",
                             "The load the routing policy sees (requests + KV usage).",
                             labels=["replica"])
    flights = GaugeMetricFamily(ROUTER_PREFIX + "in_flight",
                                "Requests the router has in flight on the replica.",
                                labels=["replica"])
    routed = CounterMetricFamily(ROUTER_PREFIX + "routed",
                                 "Requests the routing policy sent to the replica.",
                                 labels=["replica"])
    failed = CounterMetricFamily(ROUTER_PREFIX + "failed",
                                 "Requests that ended with an error because the replica failed.",
                                 labels=["replica"])
    taken_out = CounterMetricFamily(ROUTER_PREFIX + "taken_out",
                                    "Times the replica was taken out of routing.",
                                    labels=["replica"])
    for r in replicas:
        up.add_metric([r.url], 1.0 if r.up else 0.0)
        load.add_metric([r.url], r.load() if r.up else 0.0)
        flights.add_metric([r.url], len(r.flights))
        routed.add_metric([r.url], r.routed)
        failed.add_metric([r.url], r.failed)
        taken_out.add_metric([r.url], r.taken_out)
    moved = CounterMetricFamily(ROUTER_PREFIX + "retries",
                                "Requests moved to a second replica before any byte was sent.")
    moved.add_metric([], retries)
    return [up, load, flights, routed, failed, taken_out, moved]


class _Fixed:
    """A collector that yields the families it was built with (one scrape's worth)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
