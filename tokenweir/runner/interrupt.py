"""Cutting a step short at an attention-layer boundary: the order, the signal, the unwind.

The contract (shared by the single-process runner and the tensor-parallel hook):

- The SLO monitor thread writes a `CutOrder` naming the step to cut (`step_id`), never a bare
  boolean: a stale order, written after its step ended, can never match a later step because
  step ids are never reused.
- `CutSignal.should_cut(step_id, layer_index) -> bool` is what a runner asks before each
  decoder layer. It reads the order once (an atomic reference read: no lock) and also applies
  the stubbornness rule: a forward pass past `layer_fraction` of its layers refuses the cut.
  A tensor-parallel runner turns each rank's answer into a collective vote (all_reduce MAX)
  before acting, so that every rank unwinds at the same layer.
- To unwind, the layer hook raises `StepCut`; the runner catches it and reports a structured
  `CutReport` in `ModelRunnerOutput.cut` (core/outputs.py), which the engine turns into
  `Scheduler.roll_back_cut_step`. A worker that crashed reports an error, never a CutReport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from tokenweir.core.sched.slo import may_cut_at_layer


@dataclass(frozen=True, slots=True)
class CutOrder:
    step_id: int  # the step to cut; any other step ignores the order
    victim_id: str  # the running prefill that gives way (preempted on rollback)
    waiter_id: str  # the urgent request it gives way to (for logs and tests)
    issued_at: float  # engine clock


class StepCut(Exception):
    """Raised by the layer hook to unwind a forward pass; caught by the runner, never by
    callers of the runner."""

    def __init__(self, step_id: int, layer_index: int, order: CutOrder) -> None:
        super().__init__(f"step {step_id} cut before layer {layer_index} "
                         f"(victim {order.victim_id})")
        self.step_id, self.layer_index, self.order = step_id, layer_index, order


class CutSignal:
    """A one-slot mailbox between the monitor thread (writer) and the runner (reader)."""

    def __init__(self, num_layers: int, layer_fraction: float = 0.9) -> None:
        self.num_layers = num_layers
        self.layer_fraction = layer_fraction
        self._order: Optional[CutOrder] = None  # replaced whole, never mutated

    def order(self, cut_order: CutOrder) -> None:
        """Monitor side: ask for `cut_order.step_id` to be cut (replaces any older order)."""
        self._order = cut_order

    @property
    def current(self) -> Optional[CutOrder]:
        return self._order

    def order_for(self, step_id: int, layer_index: int) -> Optional[CutOrder]:
        """The order to obey before layer `layer_index` of step `step_id`, or None."""
        order = self._order
        if order is None or order.step_id != step_id:
            return None
        if not may_cut_at_layer(layer_index, self.num_layers, self.layer_fraction):
            return None
        return order

    def should_cut(self, step_id: int, layer_index: int) -> bool:
        return self.order_for(step_id, layer_index) is not None


def make_layer_hook(signal: CutSignal, step_id: int) -> Callable[[int], None]:
    """The `layer_hook` for one step's forward pass: raises StepCut when ordered."""

    def hook(layer_index: int) -> None:
        order = signal.order_for(step_id, layer_index)
        if order is not None:
            raise StepCut(step_id, layer_index, order)

    return hook
