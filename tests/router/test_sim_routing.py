"""The simulator routes with tokenweir/routing: session affinity keeps a session's turns on
one instance, and a policy of the user's own plugs in by import path."""

from __future__ import annotations

from tokenweir.sim.cluster import build_cluster
from tokenweir.sim.sessions import synthetic_sessions
from tokenweir.sim.workload import synthetic

SMALL = "smollm2-135m"
BASE = {"max_model_len": 1024, "num_gpu_blocks_override": 400}


def _instances_of_each_session(result) -> dict[str, set[int]]:
    homes: dict[str, set[int]] = {}
    for index, instance in enumerate(result.instances):
        for record in instance.requests:
            homes.setdefault(record.request_id.split(".")[0], set()).add(index)
    return homes


def test_session_affinity_keeps_every_turn_of_a_session_on_one_instance():
    sessions = synthetic_sessions(9, 40.0, seed=4, prompt="fixed:64", output="fixed:8",
                                  turns="fixed:3", user_len="fixed:16",
                                  tool_delay_ms="fixed:50", max_model_len=1024)
    result = build_cluster(BASE, [], SMALL, "h100", num_instances=3,
                           router="session-affinity", sessions=sessions, check=True).run()
    homes = _instances_of_each_session(result)
    assert len(homes) == 9 and all(len(h) == 1 for h in homes.values())
    assert len(set().union(*homes.values())) > 1  # probe: sessions really spread out
    # probe: round-robin, on the same sessions, does split sessions across instances
    rr = build_cluster(BASE, [], SMALL, "h100", num_instances=3, router="round-robin",
                       sessions=sessions, check=True).run()
    assert any(len(h) > 1 for h in _instances_of_each_session(rr).values())


def test_a_users_policy_routes_the_simulated_cluster():
    specs = synthetic(30, 100.0, seed=1, prompt="fixed:40", output="fixed:4",
                      max_model_len=1024)
    result = build_cluster(BASE, specs, SMALL, "h100", num_instances=3,
                           router="routing_plugins:LastAvailable", check=True).run()
    assert result.routed == [0, 0, 30]
