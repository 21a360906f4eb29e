"""The collective cut vote held at every attention-layer boundary of a tensor-parallel step.

Contract, on every rank, before decoder layer `i` of step `s`:

1. the rank computes its local vote: 1 if `should_cut(s, i)` is true (on the driver, "does the
   SLO monitor's target_step_id equal s"), else 0;
2. ALL ranks all-reduce the votes with MAX. The collective is entered unconditionally, so no
   rank can leave the forward pass before every rank has voted at this layer;
3. if the reduced vote is 1, every rank raises `StepCut(s, i, order)` (runner/interrupt.py):
   all ranks unwind at the SAME layer, because they all see the same reduced value. One rank
   voting 1 is enough. Each rank's `ModelRunner.execute` turns the StepCut into a `CutReport`;
   the driver's report (which names the victim) is the one the engine rolls back with.

A rank that fails instead of voting makes the collective fail (peer connection closed) or time
out (the process group's timeout), so a crash can never pass for a cut: a cut is only ever the
result of a completed vote.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from tokenweir.runner.interrupt import CutOrder, CutSignal, StepCut

# (step_id, layer_index) -> True when this rank wants the step cut before that layer.
ShouldCut = Callable[[int, int], bool]


def never_cut(step_id: int, layer: int) -> bool:
    """The local vote of a rank with no cut signal of its own (a worker, normally)."""
    return False


class VoteOnce:
    """A scripted local vote: 1 at (step_id, layer) the first time that point is reached,
    0 everywhere else. Picklable, so it can be installed on a worker."""

    def __init__(self, step_id: int, layer: int) -> None:
        self.step_id, self.layer, self.fired = step_id, layer, False

    def __call__(self, step_id: int, layer: int) -> bool:
        if self.fired or (step_id, layer) != (self.step_id, self.layer):
            return False
        self.fired = True
        return True


class SignalVote:
    """The driver's local vote from the SLO monitor's `CutSignal` (runner/interrupt.py): the
    order is read ONCE per layer and kept for the StepCut (it names the victim). A stale order
    (for another step id) never votes, and the signal's stubbornness rule (no cut past its
    layer fraction) applies."""

    def __init__(self, signal: CutSignal) -> None:
        self.signal = signal
        self.order: Optional[CutOrder] = None

    def __call__(self, step_id: int, layer: int) -> bool:
        self.order = self.signal.order_for(step_id, layer)
        return self.order is not None


def _unnamed_order(step_id: int) -> CutOrder:
    """What a rank that did not see the order itself (another rank voted) cuts under: no
    victim named; the driver's own order, when it had one, is what the engine rolls back with."""
    return CutOrder(step_id=step_id, victim_id="", waiter_id="", issued_at=0.0)


def make_vote_hook(should_cut: ShouldCut, step_id: int, device: torch.device,
                   group: Optional[dist.ProcessGroup] = None) -> Callable[[int], None]:
    """The `layer_hook` one rank passes to `CausalLM.forward` for step `step_id`."""
    vote = torch.zeros(1, dtype=torch.int32, device=device)

    def hook(layer: int) -> None:
        vote.fill_(1 if should_cut(step_id, layer) else 0)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
        if int(vote.item()):  # every rank raises here, at this same layer
            raise StepCut(step_id, layer, getattr(should_cut, "order", None)
                          or _unnamed_order(step_id))

    return hook
