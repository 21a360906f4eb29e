"""The policy interface: what a scheduling policy and a victim policy decide.

A scheduling policy decides the waiting order (the queue it makes, and any reordering at the
start of a step), may pause a running prefill for a waiter (the preempt gate), may veto
admissions for one step, and may free a paused request's blocks when the pause was not enough.
A victim policy decides who is preempted when blocks run out. The scheduler holds one of each,
given at construction, and applies their decisions; it never asks which policy it holds.

Write your own in your own file and name it `module:Class` in the config
(`--scheduling-policy mypkg.mypolicy:MyPolicy`, `--preemption-policy mypkg.mypolicy:MyVictim`):
the real engine and the simulator build the scheduler the same way, so it runs unchanged in
both. See examples/shortest_prompt_first.py.

Contracts, for every hook:
- `sched` is the scheduler, READ-ONLY to a policy: `config`, `kv` (the KV cache manager's public
  methods), `requests` (id -> Request), `running` (in the order the running pass serves them),
  `waiting` (the queue `make_waiting_queue` made), `max_model_len`. A policy may reorder
  `running` in place and its own queue in `begin_step`; it changes nothing else there.
- `plan` is the step being planned (core/sched/step_plan.py). A policy vetoes through it:
  ids in `plan.paused` get no tokens if running and stop admission at the head of the queue if
  waiting; `plan.prefills_closed = True` lets no further prefill join the step. In
  `begin_step` a policy may also lower `plan.token_budget` (never raise it): the step then
  schedules that many tokens at most (the slo policy's TPOT guard).
- No clocks, no torch: time enters as `plan.now` / `now` (the caller's clock) and through a
  latency model's prediction. Hooks run once per step or once per prefill, never per decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from tokenweir.config import SchedulerConfig
from tokenweir.core.outputs import SchedulerOutput
from tokenweir.core.sched import policy as rules
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.core.sched.queues import FCFSQueue, RequestQueue
from tokenweir.request import Request

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler
    from tokenweir.core.sched.step_plan import StepPlan


@dataclass(frozen=True, slots=True)
class Pause:
    """The preempt gate fired between steps: running prefill `victim_id` gets no tokens this
    step (it keeps its blocks and computed tokens) so that waiter `waiter_id` can be admitted.
    The scheduler counts it as a preemption of cause SLO_BETWEEN_STEPS."""

    victim_id: str
    waiter_id: str


class SchedulingPolicy:
    """Base class and the fcfs behaviour: arrival order, no gate, no veto. Subclasses override
    only what they decide. Constructed as `cls(config, costs)` by the scheduler."""

    name = "fcfs"
    # The victim policy used when `preemption_policy` is not set.
    default_victim_policy = "fcfs"
    # True for a policy that predicts TTFTs and publishes a `slo_snapshot` for a monitor thread
    # that may cut a running step (`slo_decide`); the engine and the simulator then give it a
    # TTFT predictor (`ttft_predictor`) and, in the simulator, a step latency model.
    deadline_aware = False

    def __init__(self, config: SchedulerConfig, costs: PreemptionCosts) -> None:
        self.config = config
        self.costs = costs

    def make_waiting_queue(self) -> RequestQueue:
        """The waiting queue, made once; its order is the admission order."""
        return FCFSQueue()

    def begin_step(self, sched: "Scheduler", plan: "StepPlan") -> Optional[Pause]:
        """Before the running pass: reorder, veto (`plan.paused`), and optionally pause one
        running prefill for a waiter."""
        return None

    def on_scheduled(self, sched: "Scheduler", request: Request, plan: "StepPlan") -> None:
        """`request` just got tokens in `plan`: a running prefill, or any admission. May close
        prefills for the rest of the step."""

    def victim_to_free(self, sched: "Scheduler", plan: "StepPlan") -> Optional[Request]:
        """After admission, when this step paused someone: a running request to preempt
        (recompute, not counted again) before admission is tried once more, or None."""
        return None

    def end_step(self, sched: "Scheduler", output: SchedulerOutput, now: float) -> None:
        """The step's output is made (publish what a monitor thread reads)."""

    def on_cut(self, victim_id: str, waiter_id: Optional[str]) -> None:
        """A step was cut at a layer boundary and `victim_id` preempted for `waiter_id`."""


class VictimPolicy:
    """Who is preempted when blocks run out. Constructed as `cls(config, costs)`."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig, costs: PreemptionCosts) -> None:
        self.config = config
        self.costs = costs

    def choose(self, running: Sequence[Request], requester: Request,
               cost_of: Callable[[Request], float]) -> Request:
        """A running request (`requester` included, `running` in admission order) to preempt
        so that `requester` can grow; `cost_of(r)` is the seconds preempting r would waste.
        Returning `requester` makes it give way itself. Base: the most recently admitted."""
        return rules.choose_victim(running, requester, self.name, cost_of,
                                  self.config.max_preemptions)
