"""Policies by name: the built-ins, or `module:Class` for one a user wrote (imported on use).

`make_policies(config, costs)` is how every scheduler gets its policies, in the real engine and
in the simulator alike, so a policy named in the config runs unchanged in both.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

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
           "VICTIM_POLICIES", "resolve", "make_policies", "import_from_path_or_cwd"]


def import_from_path_or_cwd(module_name: str) -> ModuleType:
    """`import module_name`; where its top-level package is on no sys.path entry but lies in
    the working directory, from there (as uvicorn resolves `app:module`): the working
    directory is appended to sys.path, behind every installed package. An ImportError raised
    inside the module (a dependency it lacks) is never retried."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.partition(".")[0]
        cwd = os.getcwd()
        if e.name != top or cwd in sys.path or not _is_module_in(cwd, top):
            raise
    sys.path.append(cwd)
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def _is_module_in(folder: str, name: str) -> bool:
    return (os.path.isdir(os.path.join(folder, name))
            or os.path.isfile(os.path.join(folder, name + ".py")))


def resolve(name: str, builtins: dict[str, type], base: type) -> type:
    """The class a policy name stands for: a built-in name, or `package.module:Class`."""
    if name in builtins:
        return builtins[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown {base.__name__} {name!r}: use one of {sorted(builtins)} "
                         f"or 'package.module:Class'")
    try:
        obj = import_from_path_or_cwd(module_name)
    except ImportError as e:
        raise ValueError(f"{base.__name__} {name!r}: cannot import {module_name!r} ({e}); "
                         f"looked on sys.path and in the working directory "
                         f"{os.getcwd()}") from e
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
