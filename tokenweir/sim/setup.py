"""What a simulated engine is built from, typed and frozen, handed down from the builders
(build.py, cluster.py) to each room that uses it: `EngineSetup` (the engine's config, the
latency model and the pools every instance of a run shares) and `Recording` (what each
instance keeps of its run). A reader sees here every value a SimEngine or Instance reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenweir.config import EngineConfig
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.sim.hardware import ModelShape


@dataclass(frozen=True)
class EngineSetup:
    """What every instance of a simulation is built from."""

    config: EngineConfig
    model: Any  # the latency model
    shape: ModelShape  # --model-shape (a fitted profile brings its own sizes instead)
    max_model_len: int
    num_blocks: int  # per instance
    num_host_blocks: int
    costs: PreemptionCosts


@dataclass(frozen=True)
class Recording:
    """What an instance keeps of its run (sim_engine.py): a StepRecord per step
    (`record_steps`); inter-token gaps in order (`record_itl`), or as exact value -> count
    (`itl_counts`), or not at all (`record_itl` False), and with each gap's end time and
    request id (`record_itl_times`: needs the gaps in order); `check`: scheduler invariants
    and the runner contract asserted after every step (tests)."""

    record_steps: bool = True
    record_itl: bool = True
    itl_counts: bool = False
    record_itl_times: bool = False
    check: bool = False

    def __post_init__(self) -> None:
        if self.record_itl_times and (self.itl_counts or not self.record_itl):
            raise ValueError("gap end times need the gaps recorded in order")
