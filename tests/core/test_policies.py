"""Policies as plug-ins: names resolve to classes (built-ins or `module:Class`), the scheduler
applies a user's victim choice as given, and scheduler.py holds no branch on which policy it
holds. Structural limits of the split are checked here too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched import scheduler as scheduler_module
from tokenweir.core.sched.policies import (SLOPolicy, SchedulingPolicy, VictimPolicy,
                                           make_policies)
from tokenweir.core.sched.policies.builtin import (CostVictim, FCFSPolicy, FCFSVictim,
                                                   PriorityPolicy, PriorityVictim)
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.core.sched.queues import DeadlineQueue, FCFSQueue, PriorityQueue
from tokenweir.core.sched.scheduler import Scheduler

from harness import FakeRunner, make_request, make_scheduler, step

CORE = Path(scheduler_module.__file__).parents[1]
EXAMPLE = "examples.shortest_prompt_first"


@pytest.mark.parametrize("name,victim,policy_cls,victim_cls,queue_cls", [
    ("fcfs", None, FCFSPolicy, FCFSVictim, FCFSQueue),
    ("priority", None, PriorityPolicy, PriorityVictim, PriorityQueue),
    ("slo", None, SLOPolicy, FCFSVictim, DeadlineQueue),
    ("fcfs", "cost", FCFSPolicy, CostVictim, FCFSQueue),
    ("slo", "priority", SLOPolicy, PriorityVictim, DeadlineQueue),
])
def test_builtin_names_keep_their_meaning(name, victim, policy_cls, victim_cls, queue_cls):
    config = SchedulerConfig(scheduling_policy=name, preemption_policy=victim)
    policy, victim_policy = make_policies(config, PreemptionCosts())
    assert type(policy) is policy_cls and type(victim_policy) is victim_cls
    assert type(policy.make_waiting_queue()) is queue_cls


def test_module_class_names_resolve_from_config():
    config = SchedulerConfig(scheduling_policy=f"{EXAMPLE}:ShortestPromptFirst",
                             preemption_policy=f"{EXAMPLE}:MostWorkLeftVictim")
    s = Scheduler(config, KVCacheManager(100, 16), 512)
    assert type(s.policy).__name__ == "ShortestPromptFirst"
    assert type(s.victim_policy).__name__ == "MostWorkLeftVictim"
    # without a victim policy named, the plug-in's default (the base class's: fcfs) applies
    s = Scheduler(SchedulerConfig(scheduling_policy=f"{EXAMPLE}:ShortestPromptFirst"),
                  KVCacheManager(100, 16), 512)
    assert type(s.victim_policy) is FCFSVictim


@pytest.mark.parametrize("bad", ["lifo", "mod:", ":Cls", "a b:C"])
def test_config_rejects_what_is_neither_a_builtin_nor_module_class(bad):
    with pytest.raises(ValueError, match="package.module:Class"):
        SchedulerConfig(scheduling_policy=bad).validate()
    with pytest.raises(ValueError, match="package.module:Class"):
        SchedulerConfig(preemption_policy=bad).validate()


@pytest.mark.parametrize("name,message", [
    ("no_such_module_xyz:Policy", "cannot import"),
    (f"{EXAMPLE}:NoSuchClass", "has no"),
    ("tokenweir.request:Request", "not a subclass"),
    (f"{EXAMPLE}:MostWorkLeftVictim", "not a subclass"),  # a victim policy is no scheduling one
])
def test_unusable_policy_classes_fail_at_construction(name, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(SchedulerConfig(scheduling_policy=name), KVCacheManager(100, 16), 512)


class OldestVictim(VictimPolicy):
    """Preempts the EARLIEST admitted request (fcfs would take the latest); records choices."""

    def __init__(self, config, costs) -> None:
        super().__init__(config, costs)
        self.chosen: list[str] = []

    def choose(self, running, requester, cost_of):
        self.chosen.append(running[0].request_id)
        return running[0]


def test_the_scheduler_preempts_exactly_whom_a_user_victim_policy_names():
    s0 = make_scheduler(num_blocks=1 + 12, block_size=4, max_model_len=48, watermark=0.0,
                        scheduler_reserve_full_isl=False)
    victim = OldestVictim(s0.config, PreemptionCosts())
    s = Scheduler(s0.config, KVCacheManager(1 + 12, 4), 48, policy=FCFSPolicy(s0.config,
                  PreemptionCosts()), victim_policy=victim)
    runner, preempted = FakeRunner(), []
    for i in range(4):
        s.add_request(make_request(f"r{i}", 6, 10))
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s, runner)
        preempted.extend(sorted(out.preempted_req_ids))
        s.check_integrity()
    assert not s.has_unfinished_requests()
    assert victim.chosen and s.stats.num_preemptions == len(victim.chosen)  # probe: it fired
    assert sorted(preempted) == sorted(victim.chosen)


# ---- the shape of the split ------------------------------------------------------------------
POLICY_NAMES = {"fcfs", "priority", "slo", "cost"}


def test_scheduler_has_no_branch_on_which_policy_it_holds():
    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)}
    assert not strings & POLICY_NAMES
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"scheduling_policy", "preemption_policy", "victim_policy_name",
                        "slo_enabled", "ttft_predictor", "slo_snapshot"}
    assert "isinstance" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_the_split_keeps_its_limits():
    lines = len(Path(scheduler_module.__file__).read_text().splitlines())
    assert lines < 300, f"scheduler.py has {lines} lines"
    long = []
    for path in CORE.rglob("*.py"):
        source = path.read_text()
        assert "import torch" not in source, f"{path} imports torch"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.name}:{node.name}")
    assert long == []


def test_base_classes_are_the_fcfs_behaviour():
    """A plug-in overriding nothing behaves as fcfs: same queue, no pause, no veto."""
    config = SchedulerConfig()
    plain = Scheduler(config, KVCacheManager(200, 16), 512,
                      policy=SchedulingPolicy(config, PreemptionCosts()),
                      victim_policy=VictimPolicy(config, PreemptionCosts()))
    fcfs = make_scheduler(num_blocks=200, max_model_len=512)
    for s in (plain, fcfs):
        for i in range(5):
            s.add_request(make_request(f"r{i}", 40 + i, 5))
    runner_a, runner_b = FakeRunner(), FakeRunner()
    while fcfs.has_unfinished_requests():
        a, _ = step(plain, runner_a)
        b, _ = step(fcfs, runner_b)
        assert a.num_scheduled_tokens == b.num_scheduled_tokens
    assert not plain.has_unfinished_requests()
