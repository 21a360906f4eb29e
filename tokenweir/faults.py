"""Fault-injection points, for tests: one per phase of handling a request.

The engine calls `fire(phase, request_id)` at each point below, guarded by `if ARMED:` so that
an unarmed point costs one dict truthiness test. A test arms a phase with `inject(...)`, which
raises `InjectedFault` whenever the point is reached for a chosen request, and counts how often
it fired (the probe that the fault really happened). Nothing arms a point outside tests.

Phases and where they fire (the request id is the one being handled):

- "admit": `EngineCore.admit_submitted`, handing a submitted request to the scheduler.
- "forward": `ModelRunner.execute`, just before the forward pass, once per request in the batch
  (a failure there is a failure of the whole forward, as a real one would be).
- "sampling": `sampler.sample_isolated`, before a row is sampled.
- "detokenize": `OutputProcessor.process`, before the new tokens are detokenized.
- "stop": `OutputProcessor._append_text`, before the stop strings are searched.
- "output": `OutputProcessor.make_output`, before the RequestOutput is built.

(The token stop rules run inside the scheduler's update; tests reach them with a request whose
parameters were corrupted after validation, see tests/engine/test_fault_isolation.py.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

PHASES = ("admit", "forward", "sampling", "detokenize", "stop", "output")

# phase -> hook(request_id); empty unless a test armed a point.
ARMED: dict[str, Callable[[str], None]] = {}


class InjectedFault(RuntimeError):
    """The exception an armed fault point raises."""


@dataclass
class FaultRecord:
    phase: str
    fired: list[str] = field(default_factory=list)  # request ids, once per firing


def fire(phase: str, request_id: str) -> None:
    hook = ARMED.get(phase)
    if hook is not None:
        hook(request_id)


@contextlib.contextmanager
def inject(phase: str, request_ids: set[str], skip: int = 0) -> Iterator[FaultRecord]:
    """Arm `phase`: reaching it for one of `request_ids` raises InjectedFault, except the
    first `skip` times (so a request can fail mid-generation). Yields the record of firings;
    disarms on exit."""
    if phase not in PHASES:
        raise ValueError(f"unknown fault phase {phase!r}; one of {PHASES}")
    record = FaultRecord(phase)
    reached = [0]

    def hook(request_id: str) -> None:
        if request_id not in request_ids:
            return
        reached[0] += 1
        if reached[0] > skip:
            record.fired.append(request_id)
            raise InjectedFault(f"injected {phase} fault for request {request_id}")

    ARMED[phase] = hook
    try:
        yield record
    finally:
        ARMED.pop(phase, None)
