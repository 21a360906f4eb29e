"""StepPlan's hand-written `__init__` (issue 36: one per step of every instance) sets every
field the dataclass declares, to its declared default, with fresh containers per plan."""

from __future__ import annotations

import dataclasses

from tokenweir.core.sched.step_plan import StepPlan


def test_the_written_init_sets_every_declared_field_to_its_default():
    plan, other = StepPlan(7, now=1.5), StepPlan(7)
    assert (plan.token_budget, plan.now, other.now) == (7, 1.5, 0.0)
    for f in dataclasses.fields(StepPlan):
        if f.name in ("token_budget", "now"):
            continue
        value = getattr(plan, f.name)  # AttributeError: a field the __init__ forgot
        expected = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert value == expected and type(value) is type(expected), f.name
        if f.default is dataclasses.MISSING:  # a container: not shared between plans
            assert value is not getattr(other, f.name), f.name
