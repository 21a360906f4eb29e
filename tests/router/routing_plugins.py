"""Routing policies of a user's own, for the plug-in tests (named as `routing_plugins:Class`;
tests/router is on sys.path in pytest, and on PYTHONPATH for the router processes)."""

from __future__ import annotations

from tokenweir.routing import UNAVAILABLE, RoutingPolicy


class LastAvailable(RoutingPolicy):
    """Always the highest-numbered instance that is available."""

    def choose(self, tokens, loads, session=None):
        return max(i for i, load in enumerate(loads) if load != UNAVAILABLE)


class NotAPolicy:
    pass
