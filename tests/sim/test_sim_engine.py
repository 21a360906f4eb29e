"""The simulator: determinism, conservation, closed-form timing, and that it drives the real
Scheduler (a cramped pool really preempts)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.sim.sim_runner import DEFAULT_EOS
from tokenweir.sim.build import build_simulation
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import (FittedLatencyModel, NoisyLatencyModel,
                                   RooflineLatencyModel, StepTotals)
from tokenweir.sim.metrics import summarize
from tokenweir.sim.workload import RequestSpec, synthetic

SMALL = "smollm2-135m"


def _result_bytes(result) -> bytes:
    body = {"requests": [dataclasses.asdict(r) for r in result.requests],
            "steps": [dataclasses.asdict(s) for s in result.steps],
            "itl": list(result.itl), "stats": dataclasses.asdict(result.stats),
            "end": result.end_time}
    return json.dumps(body, sort_keys=True).encode()


def _mixed_workload(n: int = 150, seed: int = 3) -> list[RequestSpec]:
    return synthetic(n, 2000.0, seed=seed, prompt="lognormal:120:0.7", output="uniform:1:60",
                     arrival="gamma", cv=2.0, num_prefix_groups=3, prefix_len=64,
                     priority_mix="0:0.7,1:0.3", max_model_len=1024)


def _run(specs, **kwargs):
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("num_gpu_blocks_override", 2000)  # a small pool keeps integrity checks cheap
    sim = build_simulation(kwargs, specs, SMALL, "h100", check=True)
    return sim, sim.run()


def test_two_runs_are_byte_identical():
    a = _run(_mixed_workload(), max_num_batched_tokens=256, num_gpu_blocks_override=100,
             scheduler_reserve_full_isl=False)[1]
    b = _run(_mixed_workload(), max_num_batched_tokens=256, num_gpu_blocks_override=100,
             scheduler_reserve_full_isl=False)[1]
    assert _result_bytes(a) == _result_bytes(b)
    assert a.stats.num_preemptions > 0  # the run exercised preemption, not just the easy path
    c = _run(_mixed_workload(seed=4), max_num_batched_tokens=256, num_gpu_blocks_override=100,
             scheduler_reserve_full_isl=False)[1]
    assert _result_bytes(a) != _result_bytes(c)  # the seed matters


def test_every_request_finishes_exactly_once_with_its_target_length():
    specs = _mixed_workload()
    sim, result = _run(specs, max_num_batched_tokens=256, num_gpu_blocks_override=100,
             scheduler_reserve_full_isl=False)
    by_id = {r.request_id: r for r in result.requests}
    assert sorted(by_id) == sorted(s.request_id for s in specs)
    for spec in specs:
        record = by_id[spec.request_id]
        assert record.num_finishes == 1
        assert record.num_output == spec.output_len
        assert record.finish_reason == "stop"  # EOS at the target, not the length cap
        assert record.arrival <= record.first_token <= record.finished
    assert not sim.scheduler.has_unfinished_requests()
    assert sim.scheduler.stats.generation_tokens == sum(s.output_len for s in specs)


def test_single_request_ttft_is_the_prefill_prediction():
    model = RooflineLatencyModel(get_shape("llama-7b"), get_hardware("h100"))
    spec = RequestSpec("only", arrival=2.5, prompt_len=700, output_len=3)
    sim = build_simulation({"max_num_batched_tokens": 2048, "enable_prefix_caching": False,
                            "num_gpu_blocks_override": 500},
                           [spec], "llama-7b", "h100", latency_model=model, check=True)
    result = sim.run()
    (record,) = result.requests
    assert record.first_token - record.arrival == pytest.approx(model.step_time([(700, 0)]),
                                                               rel=1e-12)
    assert result.steps[0].seconds == model.step_time([(700, 0)])  # exact, not approximate


def test_batch_of_identical_decodes_takes_the_predicted_time_per_step():
    n, prompt, output = 8, 64, 12
    model = RooflineLatencyModel(get_shape(SMALL), get_hardware("a100-80gb"))
    specs = [RequestSpec(f"d{i}", 0.0, prompt, output, index=i) for i in range(n)]
    sim = build_simulation({"max_num_batched_tokens": 4096, "num_gpu_blocks_override": 500,
                            "max_model_len": 1024}, specs, SMALL, "a100-80gb",
                           latency_model=model, check=True)
    result = sim.run()
    prefill, *decodes = result.steps
    assert prefill.num_reqs == n and prefill.num_tokens == n * prompt
    assert prefill.seconds == model.step_time([(prompt, 0)] * n)
    assert len(decodes) == output - 1
    for j, step in enumerate(decodes):
        assert step.num_reqs == step.num_decode_reqs == n
        assert step.seconds == model.step_time([(1, prompt + j)] * n)
    assert result.end_time == pytest.approx(prefill.seconds + sum(s.seconds for s in decodes))
    assert sorted(result.itl) == pytest.approx(sorted(s.seconds for s in decodes for _ in range(n)),
                                              rel=1e-9)


def test_a_cramped_pool_preempts_through_the_real_scheduler():
    specs = synthetic(60, float("inf"), seed=1, prompt="fixed:100", output="fixed:80",
                      max_model_len=512)
    roomy_sim, roomy = _run(specs, max_model_len=512, num_gpu_blocks_override=2000,
                            enable_prefix_caching=False)
    sim, cramped = _run(specs, max_model_len=512, num_gpu_blocks_override=40,
                        enable_prefix_caching=False, scheduler_reserve_full_isl=False)
    assert type(sim.scheduler) is Scheduler
    assert roomy.stats.num_preemptions == 0
    assert cramped.stats.num_preemptions > 0
    metrics = summarize(cramped)
    assert metrics["preemptions"] == cramped.stats.num_preemptions
    assert metrics["recompute_tax"] > 0
    assert [r.num_output for r in cramped.requests] == [80] * 60
    assert metrics["sim_seconds"] > summarize(roomy)["sim_seconds"]


def test_prefix_groups_hit_the_prefix_cache():
    grouped = synthetic(40, 5.0, seed=2, prompt="fixed:200", output="fixed:4",
                        num_prefix_groups=2, prefix_len=160)
    plain = synthetic(40, 5.0, seed=2, prompt="fixed:200", output="fixed:4")
    assert summarize(_run(grouped)[1])["prefix_hit_rate"] > 0.5
    assert summarize(_run(plain)[1])["prefix_hit_rate"] == 0.0


def test_sim_runner_samples_eos_at_the_target_and_non_eos_before():
    spec = RequestSpec("x", 0.0, 20, 5)
    sim = build_simulation({"num_gpu_blocks_override": 100, "max_model_len": 256}, [spec], SMALL, "h100", check=True)
    tokens = []
    original = sim.scheduler.update_from_output

    def spy(out, runner_out, now=0.0):
        tokens.extend(runner_out.sampled_token_ids.get("x", []))
        return original(out, runner_out, now)

    sim.scheduler.update_from_output = spy
    sim.run()
    assert len(tokens) == 5 and tokens[-1] == DEFAULT_EOS
    assert DEFAULT_EOS not in tokens[:-1]


def test_tensor_parallel_speeds_up_a_big_prefill_and_costs_all_reduce():
    shape, hw = get_shape("llama-7b"), get_hardware("h100")
    one, two = RooflineLatencyModel(shape, hw, 1), RooflineLatencyModel(shape, hw, 2)
    assert two.step_time([(4096, 0)]) < one.step_time([(4096, 0)])
    assert two._s_allreduce_fixed > 0 and one._s_allreduce_fixed == 0
    # decode is bandwidth-bound: about the time to stream the weights once
    weights = shape.num_matmul_params * hw.dtype_bytes / hw.effective_bandwidth
    assert one.step_time([(1, 100)]) == pytest.approx(weights + hw.step_overhead_s, rel=0.05)


def test_noisy_latency_model_jitters_the_runner_not_the_forecast():
    base = RooflineLatencyModel(get_shape(SMALL), get_hardware("h100"))
    totals = StepTotals.of_chunks([(256, 0), (1, 300)])
    draws = [NoisyLatencyModel(base, 0.1, seed=7).predict_totals(totals) for _ in range(2)]
    assert draws[0] == draws[1]  # seeded: a run is repeatable
    noisy = NoisyLatencyModel(base, 0.1, seed=7)
    samples = [noisy.predict_totals(totals) / base.predict_totals(totals) for _ in range(4000)]
    assert len(set(samples)) == 4000  # probe: every step really draws
    assert sum(samples) / len(samples) == pytest.approx(1.0, abs=0.01)  # mean 1
    assert noisy.step_time([(256, 0)]) == base.step_time([(256, 0)])  # forecasts: noise-free
    assert NoisyLatencyModel(base, 0.0).predict_totals(totals) == base.predict_totals(totals)
    with pytest.raises(ValueError):
        NoisyLatencyModel(base, -0.1)


def test_a_noisy_fitted_profile_runs_a_simulation():
    """The wrapper passes the fitted profile's KV size through to the pool sizing."""
    fitted = FittedLatencyModel({"const": 0.01, "prefill_tokens": 1e-4, "decode_rows": 1e-3},
                                kv_bytes_per_token=1024, max_model_len=1024)
    specs = _mixed_workload(n=40)
    results = []
    for model in (fitted, NoisyLatencyModel(fitted, 0.2, seed=1)):
        sim = build_simulation({"max_model_len": 1024}, specs, SMALL, "h100",
                               latency_model=model)
        results.append(sim.run())
    assert all(len(r.requests) == 40 for r in results)
    assert results[0].end_time != results[1].end_time  # probe: the jitter changed the run
