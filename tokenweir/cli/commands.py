"""Every `tokenweir` subcommand as one row: its name, its help, the config classes its flags
come from, and the function that runs it ("module:function", imported only when that command
runs, so `tokenweir --help` loads neither torch nor the simulator). The function receives the
parsed namespace, whose attributes are the configs' field names, and returns the exit status.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.config import (BenchServeConfig, CalibrateConfig, ClusterConfig,
                              FrontierStudyConfig, GenerateConfig, PoliciesStudyConfig,
                              PoolStudyConfig, RouterConfig, ServeConfig, SimulateConfig,
                              SweepConfig, TimelineConfig)


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]            # ("bench", "serve") is `tokenweir bench serve`
    help: str
    configs: tuple[type, ...]        # config dataclasses whose fields are this command's flags
    run: str                         # "module:function" taking the namespace, returning a status
    engine_flags: bool = False       # also every engine flag (config.CONFIG_CLASSES)
    engine_exclude: tuple[str, ...] = ()  # engine fields a config above spells instead


@dataclass(frozen=True)
class CommandGroup:
    """A command that only holds subcommands (`tokenweir bench serve`): the chosen one's
    name lands in the namespace attribute `dest`."""
    name: str
    help: str
    dest: str


_SIM_RUN = "tokenweir.sim.cli:run"
# The simulator's tensor-parallel degree is its own field (SimTargetConfig.tp, spelled
# --tensor-parallel-size, alias --tp): the engine's field of that name would be a second flag
# that the simulator ignores. Likewise the engine's --trace (step_trace): the simulator's
# --trace is its workload file.
_SIM_TP = ("tensor_parallel_size", "step_trace")
# The simulator prices a model shape, never loads weights: its --model picks a shipped config
# (SimTargetConfig.model_name), so the engine's --model is left out. --batch-invariant picks
# kernels, which the simulator never runs (its step times come from a roofline or a fitted
# --profile): left out too, so `simulate --batch-invariant` is refused by the parser.
_SIM_EXCLUDE = _SIM_TP + ("model", "batch_invariant")

GROUPS: tuple[CommandGroup, ...] = (
    CommandGroup("bench", "benchmarks", dest="bench_command"),
    CommandGroup("study", "canned simulator studies: CSV + PNG + table", dest="study"),
)

COMMANDS: tuple[Command, ...] = (
    Command(("generate",), "answer prompts offline and print a summary", (GenerateConfig,),
            "tokenweir.cli.generate:run", engine_flags=True),
    Command(("serve",), "run the OpenAI-compatible HTTP server", (ServeConfig,),
            "tokenweir.cli.serve:run", engine_flags=True),
    Command(("router",), "an OpenAI-compatible front that forwards each request to one of "
            "several `tokenweir serve` replicas", (RouterConfig,),
            "tokenweir.router.cli:run_router"),
    Command(("bench", "serve"), "load-test an OpenAI-compatible server", (BenchServeConfig,),
            "tokenweir.bench.serve:main"),
    Command(("simulate",), "simulate serving a workload on a virtual clock",
            (SimulateConfig, ClusterConfig), _SIM_RUN, engine_flags=True,
            engine_exclude=_SIM_EXCLUDE),
    Command(("sweep",), "simulate a grid of config values in parallel", (SweepConfig,),
            _SIM_RUN, engine_flags=True, engine_exclude=_SIM_EXCLUDE),
    Command(("study", "frontier"), "TTFT of a long prompt vs p99 ITL of steady decodes, one "
            "point per chunk size", (FrontierStudyConfig,), _SIM_RUN),
    Command(("study", "pool"), "steps and preemptions vs KV pool size (hockey stick)",
            (PoolStudyConfig,), _SIM_RUN),
    Command(("study", "policies"), "victim policies x preemption modes under memory pressure",
            (PoliciesStudyConfig,), _SIM_RUN),
    Command(("calibrate",), "time the real runner over a grid of steps and fit a step-time "
            "profile for the simulator", (CalibrateConfig,), "tokenweir.sim.calibrate:run"),
    Command(("timeline",), "the schedule as one self-contained HTML page: a row per request, "
            "a column per step", (TimelineConfig,), "tokenweir.timeline.cli:run"),
)
