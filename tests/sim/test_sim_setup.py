"""The typed set-up (issue 36): SimEngine, Instance and Simulation are built from one frozen
EngineSetup and one Recording instead of a dozen loose values. A refactor: the runs below
were recorded before it (the tree of commit 41e2eda: the same code, sha256 of `cluster_result_json`) and
must decide exactly the same; each run's probe shows that its feature really ran."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from tokenweir.sim.build import build_simulation, engine_setup
from tokenweir.sim.cluster import build_cluster, cluster_result_json
from tokenweir.sim.instance import Instance
from tokenweir.sim.sessions import synthetic_sessions
from tokenweir.sim.setup import Recording
from tokenweir.sim.workload import synthetic

ENGINE = {"max_model_len": 2048, "num_gpu_blocks_override": 200, "max_num_batched_tokens": 512}
RECORDED = {
    "pd": "aba5b4c8adb22ac19a825778121d0b27523bd99f63ccad391fc6c2ff88232e2b",
    "pp-sessions": "2b7722d58605b601dd047592b3d1374ae76041ad1cd53efec7675d31181019b1",
    "slo": "8f927c66a0341217acbacc9654fb369d50119414de2c811fbcd5a159f48bd43a",
}


def _specs(n: int, rate: float, seed: int):
    return synthetic(n, rate, seed=seed, prompt="lognormal:200:0.8", output="lognormal:48:0.8",
                     max_model_len=2048, num_prefix_groups=6, prefix_len=64)


def _pd():
    return build_cluster(ENGINE, _specs(150, 80.0, 1), "smollm2-135m", pd=(1, 2),
                         router="prefix-aware", link_gbps=50.0, record_itl_times=True,
                         check=True)


def _pp_sessions():
    sessions = synthetic_sessions(20, 30.0, seed=3, prompt="fixed:100", output="fixed:30",
                                  turns="fixed:3", tool_delay_ms="fixed:40", max_model_len=2048)
    return build_cluster(dict(ENGINE, preemption_mode="swap"), _specs(100, 60.0, 2), pp_size=2,
                         num_instances=2, router="least-loaded", sessions=sessions,
                         itl_counts=True)


def _slo():
    """Long prompts on the CPU profile (steps of seconds); a third of the requests urgent."""
    specs = synthetic(40, 3.0, seed=4, prompt="lognormal:900:0.6", output="lognormal:16:0.5",
                      max_model_len=4096)
    specs = [dataclasses.replace(s, ttft_slo_ms=900.0 if i % 3 == 0 else 20_000.0)
             for i, s in enumerate(specs)]
    engine = {"max_model_len": 4096, "num_gpu_blocks_override": 1000,
              "max_num_batched_tokens": 2048, "scheduling_policy": "slo",
              "slo_mid_step_cut": True}
    return build_cluster(engine, specs, "smollm2-135m", "cpu-epyc-2c", check=True)


def _stat(body: dict, name: str) -> int:
    return sum(i["stats"][name] for i in body["instances"])


@pytest.mark.parametrize("name, build, probe", [
    ("pd", _pd, lambda body: len(body["transfers"])),
    ("pp-sessions", _pp_sessions,
     lambda body: min(_stat(body, "num_swapped_out"), max(body["max_in_flight"]) - 1,
                      sum(r["request_id"].endswith(".t2") for r in body["requests"]))),
    ("slo", _slo, lambda body: _stat(body, "slo_cut_steps")),
], ids=RECORDED.keys())
def test_runs_decide_as_before_the_typed_setup(name, build, probe):
    text = cluster_result_json(build().run())
    assert probe(json.loads(text)) > 0
    assert hashlib.sha256(text.encode()).hexdigest() == RECORDED[name]


def test_an_instance_reads_every_value_from_its_setup():
    setup = engine_setup(dict(ENGINE, preemption_mode="swap", swap_space=1), "smollm2-135m")
    inst = Instance(3, setup, "decode", 2, Recording(record_steps=False, itl_counts=True))
    assert (inst.index, inst.role, inst.pp_size) == (3, "decode", 2)
    assert inst.kv.host_pool.num_blocks == setup.num_host_blocks > 0
    assert inst.kv.num_usable_blocks == setup.num_blocks - 1  # the null block
    assert inst.max_model_len == inst.scheduler.max_model_len == setup.max_model_len
    assert inst.scheduler.costs is setup.costs and inst.runner.latency_model is setup.model
    assert not inst.record_steps and type(inst.itl).__name__ == "ValueCounts"


def test_recording_rejects_gap_times_without_gaps_in_order():
    with pytest.raises(ValueError, match="gap end times"):
        Recording(itl_counts=True, record_itl_times=True)
    with pytest.raises(ValueError, match="gap end times"):
        build_simulation({}, [], "smollm2-135m", record_itl=False, record_itl_times=True)
