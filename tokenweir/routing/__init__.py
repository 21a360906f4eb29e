"""Routing policies, shared by the simulator's cluster and the real router: by name, or
`package.module:Class` for one a user wrote (imported on use). See base.py for the contract."""

from __future__ import annotations

from tokenweir.routing.base import UNAVAILABLE, RoutingPolicy, least_loaded
from tokenweir.routing.prefix_aware import PrefixAwareRouter
from tokenweir.routing.simple import LeastLoadedRouter, RoundRobinRouter, SessionAffinityRouter

ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round-robin": RoundRobinRouter, "least-loaded": LeastLoadedRouter,
    "prefix-aware": PrefixAwareRouter, "session-affinity": SessionAffinityRouter}
ROUTERS = tuple(ROUTING_POLICIES)  # the built-in names (the CLI's choices)

__all__ = ["UNAVAILABLE", "RoutingPolicy", "least_loaded", "PrefixAwareRouter",
           "LeastLoadedRouter", "RoundRobinRouter", "SessionAffinityRouter",
           "ROUTING_POLICIES", "ROUTERS", "routing_policy_class", "make_router"]


def routing_policy_class(name: str) -> type[RoutingPolicy]:
    """The class a routing-policy name stands for: a built-in name or `package.module:Class`
    (the scheduling policies' rule, core/sched/policies)."""
    from tokenweir.core.sched.policies import resolve

    return resolve(name, ROUTING_POLICIES, RoutingPolicy)


def make_router(name: str, num_instances: int, block_size: int) -> RoutingPolicy:
    return routing_policy_class(name)(num_instances, block_size)
