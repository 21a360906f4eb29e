"""tokenweir/routing: one set of routing policies for the simulator and the router, plugged in
by name or `package.module:Class`, never choosing an unavailable instance."""

from __future__ import annotations

import random

import pytest

from tokenweir import config
from tokenweir.routing import (ROUTERS, ROUTING_POLICIES, UNAVAILABLE, LeastLoadedRouter,
                               PrefixAwareRouter, RoundRobinRouter, RoutingPolicy,
                               SessionAffinityRouter, make_router, routing_policy_class)
from tokenweir.sim import cluster, simulator


def test_the_simulator_builds_its_routers_from_the_shared_module():
    assert cluster.make_router is make_router
    assert simulator.RoundRobinRouter is RoundRobinRouter


def test_configs_know_the_same_built_in_names():
    assert config.ROUTING_POLICY_NAMES == ROUTERS == tuple(ROUTING_POLICIES)


def test_plug_in_by_import_path():
    policy = make_router("routing_plugins:LastAvailable", 3, 16)
    assert type(policy).__name__ == "LastAvailable"
    assert policy.choose([1, 2, 3], [0, 0, UNAVAILABLE]) == 1


@pytest.mark.parametrize("name, message", [
    ("no-such-policy", "unknown RoutingPolicy"),
    ("routing_plugins:Missing", "has no"),
    ("routing_plugins:NotAPolicy", "not a subclass"),
    ("no_such_module_xyz:Class", "cannot import")])
def test_bad_names_are_refused_clearly(name, message):
    with pytest.raises(ValueError, match=message):
        routing_policy_class(name)


def test_router_config_refuses_an_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown routing policy"):
        config.RouterConfig(replicas=("http://x",), routing_policy="fastest")
    assert config.RouterConfig(replicas=("http://x",), routing_policy="a.b:C")


@pytest.mark.parametrize("name", ROUTERS)
def test_no_policy_chooses_an_unavailable_instance(name):
    rng = random.Random(7)
    policy = make_router(name, 4, 4)
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    chose_down = 0
    for i in range(400):
        loads = [rng.randrange(5) for _ in range(4)]
        down = rng.sample(range(4), rng.randrange(4))  # at most 3 of 4
        for d in down:
            loads[d] = UNAVAILABLE
        tokens = prefixes[i % 3] + [rng.randrange(100) for _ in range(8)]
        chose_down += policy.choose(tokens, loads, session=i % 5) in down
    assert chose_down == 0


def test_round_robin_passes_a_down_instances_turn_on():
    rr = RoundRobinRouter(3)
    assert [rr.choose([], [0, 0, 0]) for _ in range(3)] == [0, 1, 2]
    assert [rr.choose([], [0, UNAVAILABLE, 0]) for _ in range(4)] == [0, 2, 0, 2]


def test_least_loaded_counts_fractional_loads():
    assert LeastLoadedRouter(3).choose([], [2.5, 2.25, 3]) == 1


def test_session_affinity_keeps_a_session_and_moves_it_when_its_home_fails():
    policy = SessionAffinityRouter(3)
    home = policy.choose([], [1, 0, 2], session="alice")
    assert home == 1
    assert policy.choose([], [0, 9, 0], session="alice") == 1  # load does not move it
    assert policy.choose([], [5, UNAVAILABLE, 0], session="alice") == 2  # its home is down
    assert policy.choose([], [0, 0, 9], session="alice") == 2  # and it stays moved
    assert policy.choose([], [3, 0, 1], session=None) == 1  # no session: least loaded


def test_session_affinity_forgets_the_oldest_sessions_beyond_capacity():
    policy = SessionAffinityRouter(2, capacity=2)
    policy.choose([], [0, 1], session="a")
    policy.choose([], [1, 0], session="b")
    policy.choose([], [1, 0], session="c")  # "a" is forgotten
    assert policy.choose([], [1, 0], session="a") == 1
    assert policy.choose([], [0, 1], session="c") == 1


def test_prefix_aware_follows_a_shared_prefix_and_leaves_a_down_instance():
    policy = PrefixAwareRouter(2, block_size=4)
    system = list(range(16))
    first = policy.choose(system + [100, 101, 102, 103], [0, 0])
    assert policy.choose(system + [200, 201, 202, 203], [1, 0]) == first  # affinity
    loads = [0, 0]
    loads[first] = UNAVAILABLE
    assert policy.choose(system + [300, 301, 302, 303], loads) == 1 - first


def test_every_built_in_is_a_routing_policy():
    assert all(issubclass(c, RoutingPolicy) for c in ROUTING_POLICIES.values())
