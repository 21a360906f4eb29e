"""Steps of plain decodes planned and updated in one pass (core/sched/decode_pass.py) decide
exactly what the general paths decide: the same seeded workloads, with the passes on and off,
give the same request records, step records, counters, inter-token gaps (and their times),
router decisions and digests, under preemption (recompute and swap), the prefix cache, the
priority and slo policies (pauses and mid-step cuts), a sliding window, pipelining and a
cluster. Probes: each pass really took steps (and the general paths took others), and each
configuration really preempted, swapped, paused, cut or hit the cache as it claims. Guard: a
pass that skips the block-boundary allocation is caught by the same comparison."""

from __future__ import annotations

import dataclasses

import pytest

from tokenweir.core.sched import decode_pass
from tokenweir.sim import sim_engine
from tokenweir.sim.build import build_simulation
from tokenweir.sim.cluster import build_cluster
from tokenweir.sim.digest import cluster_digest, instance_digest
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.sim.workload import synthetic

SMALL = "smollm2-135m"
CRAMPED = {"max_model_len": 1024, "num_gpu_blocks_override": 130,
           "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False}


def _specs(seed: int, n: int = 160, rate: float = 300.0, **kw):
    return synthetic(n, rate, seed=seed, prompt="lognormal:90:0.7", output="lognormal:40:0.9",
                     num_prefix_groups=3, prefix_len=48, max_model_len=1024, **kw)


# name -> (engine args, workload kwargs, build kwargs, what must have happened)
CASES = {
    "recompute+prefix, gaps in order with times": (
        CRAMPED, {}, {"record_itl_times": True}, ("preemptions", "prefix_hits")),
    "swap, gaps as counts": (
        dict(CRAMPED, preemption_mode="swap", swap_space=0.01), {}, {"itl_counts": True},
        ("swaps",)),
    "priority, no prefix cache, checked": (
        dict(CRAMPED, scheduling_policy="priority", enable_prefix_caching=False),
        {"priority_mix": "0:0.3,1:0.7"}, {"check": True}, ("preemptions",)),
    "slo pauses and cuts": (
        dict(CRAMPED, scheduling_policy="slo", num_gpu_blocks_override=400,
             max_num_batched_tokens=512),
        {"slo_mix": True}, {"itl_counts": True}, ("slo", "preemptions")),
    "pipelined, chunked": (
        dict(CRAMPED, num_gpu_blocks_override=400, long_prefill_token_threshold=64), {},
        {"pp_size": 2}, ("prefix_hits",)),
}


def _slo_specs(seed: int):
    """Every third request urgent (TTFT 2.5 ms per prompt token + 400 ms), the others
    relaxed, at a load that makes the CPU profile's prefills pause and cut for them."""
    specs = synthetic(120, 8.0, seed=seed, prompt="lognormal:300:0.7", output="lognormal:30:0.9",
                      num_prefix_groups=3, prefix_len=48, max_model_len=1024)
    return [dataclasses.replace(s, ttft_slo_ms=s.prompt_len * 2.5 + 400 if i % 3 == 0
                                else s.prompt_len * 12 + 8000) for i, s in enumerate(specs)]


def _simulation(engine, workload, build, seed, on: bool):
    if workload.get("slo_mix"):
        specs, hardware = _slo_specs(seed), "cpu-epyc-2c"
    else:
        specs, hardware = _specs(seed, **workload), "h100"
    sim = build_simulation(engine, specs, SMALL, hardware, **build)
    sim.engine.plain_decode_pass = on
    return sim


def _everything(sim, result) -> dict:
    """What a run decided, field by field (a mismatch names the field)."""
    engine = sim.engine
    return {"records": [dataclasses.asdict(r) for r in result.requests],
            "steps": result.steps, "stats": result.stats, "itl": list(result.itl),
            "itl_times": list(engine.itl_times or ()), "itl_ids": engine.itl_ids,
            "end": result.end_time, "prefix": (result.prefix_hit_tokens,
                                                result.prefix_query_tokens),
            "digest": instance_digest(result)}


class _Counting:
    """Counts the steps each pass took (a probe), wrapping the names sim_engine calls."""

    def __init__(self, monkeypatch) -> None:
        self.planned = self.updated = self.steps = 0
        plan, update = sim_engine.plan_plain_decodes, sim_engine.update_plain_decodes

        def counting_plan(sched, now):
            out = plan(sched, now)
            self.planned += out is not None
            return out

        def counting_update(sched, out, runner_out, decoded):
            done = update(sched, out, runner_out, decoded)
            self.updated += done
            self.steps += 1
            return done

        monkeypatch.setattr(sim_engine, "plan_plain_decodes", counting_plan)
        monkeypatch.setattr(sim_engine, "update_plain_decodes", counting_update)


def _check_happened(what, stats, result) -> None:
    if "preemptions" in what:
        assert stats.num_preemptions > 0
    if "swaps" in what:
        assert stats.num_swapped_out > 0
    if "prefix_hits" in what:
        assert result.prefix_hit_tokens > 0
    if "slo" in what:
        assert stats.preemptions_by_cause["slo-between-steps"] > 0 and stats.slo_cut_steps > 0


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_pass_decides_as_the_general_paths(case, seed, monkeypatch):
    engine, workload, build, what = CASES[case]
    plain = _simulation(engine, workload, build, seed, on=False)
    want = _everything(plain, plain.run())
    counting = _Counting(monkeypatch)
    fast = _simulation(engine, workload, build, seed, on=True)
    result = fast.run()
    got = _everything(fast, result)
    for key in want:
        assert got[key] == want[key], key
    _check_happened(what, result.stats, result)
    # probes: the update pass took steps and left others to update_from_output; the plan
    # pass too, except under slo (its hooks) and pipelining (batches in flight: general path)
    assert 0 < counting.updated < counting.steps
    if case.startswith("slo"):
        assert counting.planned == 0
    elif not case.startswith("pipelined"):
        assert 0 < counting.planned < counting.steps


def test_a_sliding_window_run_decides_as_the_general_paths(monkeypatch):
    """The update pass under a 128-token window (the plan pass declines: blocks slide out)."""
    shape = dataclasses.replace(get_shape("mistral-7b"), sliding_window=128)
    model = RooflineLatencyModel(shape, get_hardware("h100"))
    specs = synthetic(12, 50.0, seed=3, prompt="lognormal:200:0.5", output="lognormal:300:0.5",
                      max_model_len=1024)
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "num_gpu_blocks_override": 600,
              "max_model_len": 1024}
    runs = []
    for on in (False, True):
        counting = _Counting(monkeypatch)
        sim = build_simulation(engine, specs, "mistral-7b", latency_model=model, check=True)
        sim.engine.plain_decode_pass = on
        runs.append(_everything(sim, sim.run()))
    assert runs[0] == runs[1]
    assert counting.planned == 0 and counting.updated > 100


def _cluster(on: bool, specs):
    sim = build_cluster({"max_num_seqs": 64, "max_num_batched_tokens": 512,
                         "num_gpu_blocks_override": 300, "max_model_len": 1024}, specs, SMALL,
                        "h100", num_instances=6, router="prefix-aware", record_steps=False,
                        itl_counts=True)
    for inst in sim.instances:
        inst.plain_decode_pass = on
    return sim


def test_a_prefix_aware_cluster_decides_as_the_general_paths(monkeypatch):
    specs = _specs(4, n=600, rate=900.0)
    plain = _cluster(False, specs).run()
    counting = _Counting(monkeypatch)
    fast = _cluster(True, specs).run()
    assert cluster_digest(fast) == cluster_digest(plain)
    assert fast.routed == plain.routed
    assert [dataclasses.asdict(r) for r in fast.overall.requests] == \
        [dataclasses.asdict(r) for r in plain.overall.requests]
    assert 0 < counting.planned < counting.steps and 0 < counting.updated < counting.steps
    assert fast.overall.prefix_hit_tokens > 0


def test_a_pass_that_skips_the_block_boundary_is_caught(monkeypatch):
    """Guard: the plan pass with the boundary check broken (no request ever on a boundary,
    so no block is allocated for the next one) must make the comparison above fail. (It
    does so here by crashing: the update publishes the block that was never allocated.)"""
    engine, workload, build, _ = CASES["recompute+prefix, gaps in order with times"]
    plain = _simulation(engine, workload, build, 1, on=False)
    want = _everything(plain, plain.run())
    monkeypatch.setattr(decode_pass, "_offsets_in_block", lambda computed, _: [1] * len(computed))
    fast = _simulation(engine, workload, build, 1, on=True)
    try:
        got = _everything(fast, fast.run())
    except IndexError:  # caught: a filled block the pass never allocated was published
        return
    assert got != want
