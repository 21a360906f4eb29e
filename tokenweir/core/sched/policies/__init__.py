"""Policies by name: the built-ins, or `module:Class` for one a user wrote (imported on use).

`make_policies(config, costs)` is how every scheduler gets its policies, in the real engine and
in the simulator alike, so a policy named in the config runs unchanged in both.
"""

from __future__ import annotations

import importlib

from tokenweir.config import SchedulerConfig
from tokenweir.core.sched.policies.base import Pause, SchedulingPolicy, VictimPolicy
from tokenweir.core.sched.policies.builtin import (CostVictim, FCFSPolicy, FCFSVictim,
                                                   PriorityPolicy, PriorityVictim)
from tokenweir.core.sched.policies.slo import SLOPolicy
from tokenweir.core.sched.policy import PreemptionCosts

SCHEDULING_POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy, "priority": PriorityPolicy, "slo": SLOPolicy}
VICTIM_POLICIES: dict[str, type[VictimPolicy]] = {
    "fcfs": FCFSVictim, "priority": PriorityVictim, "cost": CostVictim}

__all__ = ["Pause", "SchedulingPolicy", "VictimPolicy", "SLOPolicy", "SCHEDULING_POLICIES",
           "VICTIM_POLICIES", "resolve", "make_policies"]


def resolve(name: str, builtins: dict[str, type], base: type) -> type:
    """The class a policy name stands for: a built-in name, or `package.module:Class`."""
    if name in builtins:
        return builtins[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown {base.__name__} {name!r}: use one of {sorted(builtins)} "
                         f"or 'package.module:Class'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{base.__name__} {name!r}: cannot import {module_name!r} ({e}); "
                         f"is it on PYTHONPATH?") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{base.__name__} {name!r}: {module_name} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{name!r} is not a subclass of {base.__module__}.{base.__name__}")
    return obj


def make_policies(config: SchedulerConfig, costs: PreemptionCosts
                  ) -> tuple[SchedulingPolicy, VictimPolicy]:
    """The scheduling policy `config.scheduling_policy` names, and the victim policy
    `config.preemption_policy` names (default: the scheduling policy's own default)."""
    policy = resolve(config.scheduling_policy, SCHEDULING_POLICIES, SchedulingPolicy)(
        config, costs)
    victim_name = config.preemption_policy or policy.default_victim_policy
    victim = resolve(victim_name, VICTIM_POLICIES, VictimPolicy)(config, costs)
    return policy, victim
