"""A digest of everything a simulation decided, streamed into SHA-256 without building one big
document (a million-request run's records would be gigabytes of JSON).

Covered: every user request's record (times as exact float reprs, counters, finish reason),
every instance's records, counters (SchedulerStats) and inter-token gaps (as value counts), and
the router's decisions. Not covered: wall-clock time. Two runs of the same inputs give the same
hex string; any change of a decision or a time changes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.simulator import ClusterResult, SimResult


def _feed_records(h: "hashlib._Hash", records) -> None:
    for r in records:
        h.update(repr(dataclasses.astuple(r)).encode())
        h.update(b"\n")


def _feed_instance(h: "hashlib._Hash", r: SimResult) -> None:
    _feed_records(h, r.requests)
    h.update(json.dumps(dataclasses.asdict(r.stats), sort_keys=True).encode())
    gaps = r.itl.counts if isinstance(r.itl, ValueCounts) else ValueCounts(r.itl).counts
    h.update(repr(sorted(gaps.items())).encode())
    h.update(repr((len(r.steps), r.prefix_hit_tokens, r.prefix_query_tokens)).encode())


def instance_digest(result: SimResult) -> str:
    """SHA-256 hex of one instance's run (a single-instance Simulation's result)."""
    h = hashlib.sha256()
    _feed_instance(h, result)
    h.update(repr(result.end_time).encode())
    return h.hexdigest()


def cluster_digest(result: ClusterResult) -> str:
    """SHA-256 hex of a cluster run's decisions (see the module docstring)."""
    h = hashlib.sha256()
    _feed_records(h, result.overall.requests)
    for r in result.instances:
        _feed_instance(h, r)
    h.update(repr((result.routed, result.max_in_flight, result.overall.end_time)).encode())
    return h.hexdigest()
