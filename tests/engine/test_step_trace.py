"""Real-engine step traces (issue 16): EngineCore's step observer, `--trace FILE` on LLM and
`tokenweir generate`, the Chrome form, and what tracing costs."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from tokenweir.config import EngineConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.engine.engine_core import EngineCore
from tokenweir.request import SamplingParams
from tokenweir.sim.latency import ConstantLatencyModel
from tokenweir.sim.sim_engine import make_request
from tokenweir.sim.sim_runner import SimRunner
from tokenweir.sim.workload import synthetic
from tokenweir.timeline.chrome import load_chrome_trace
from tokenweir.timeline.records import StepRing, load_jsonl
from tokenweir.timeline.recorder import StepRecorder
from tokenweir.timeline.tracer import attach_tracer, chrome_path_for

REAL_PHASES = {"schedule", "prepare", "forward", "sample", "update", "output"}


def core_on_sim_runner(mode: str, blocks: int = 40):
    """An EngineCore over the simulator's runner (no model) and a cramped pool."""
    config = EngineConfig.from_kwargs(max_num_batched_tokens=128, max_model_len=512,
                                      num_gpu_blocks_override=blocks, preemption_mode=mode)
    kv = KVCacheManager(blocks, 16, enable_prefix_caching=True,
                        num_host_blocks=400 if mode == "swap" else 0)
    scheduler = Scheduler(config.scheduler, kv, 512)
    targets: dict[str, int] = {}
    ticks = itertools.count()
    core = EngineCore(scheduler, SimRunner(ConstantLatencyModel(0.01), targets),
                      clock=lambda: next(ticks) * 0.001)
    specs = synthetic(30, 100.0, seed=3, prompt="lognormal:120:0.5", output="uniform:10:60",
                      num_prefix_groups=2, prefix_len=48)
    for s in specs:
        targets[s.request_id] = s.output_len
        core.add_request(make_request(s.request_id, s.prompt_tokens(), s.output_len, 512, 0.0))
    return core, specs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_step_observer_records_what_the_scheduler_planned(mode):
    """The tracer builds each step's record after its update; what it records equals what
    the simulator's StepRecorder reads from the same SchedulerOutput before the update,
    queue lengths, pool usage and paused ids included (read at the same moment: issue 36)."""
    core, specs = core_on_sim_runner(mode)
    scheduler = core.scheduler
    ring = StepRing(capacity=100_000)
    tracer = attach_tracer(core, ring)
    recorder, planned, after_update = StepRecorder(scheduler, scheduler.kv), [], []
    update = scheduler.update_from_output

    def spy(out, runner_out, now=0.0, *rest):
        if not out.is_empty:
            planned.append(recorder.record(now, 0.0, out))
        outputs = update(out, runner_out, now, *rest)
        if not out.is_empty:
            after_update.append((scheduler.num_running, scheduler.num_waiting,
                                 round(scheduler.kv.usage(), 5)))
        return outputs

    scheduler.update_from_output = spy
    while core.has_unfinished_requests():
        core.step()
    tracer.close()
    steps = list(ring.steps)
    assert len(steps) == len(planned) > 30
    moment = ("running", "waiting", "kv_usage", "paused")
    for got, want in zip(steps, planned):
        assert got["reqs"] == want["reqs"]
        assert (got["preempted"], got["swapped"]) == (want["preempted"], want["swapped"])
        assert got["prefix_hits"] == want["prefix_hits"]
        assert [got[k] for k in moment] == [want[k] for k in moment]
        assert set(got["phases"]) == {"schedule", "execute", "update"}
        assert sum(got["phases"].values()) <= got["duration"] + 1e-12
    # The probe: reading after the update would have differed (requests finished in steps).
    assert sum((s["running"], s["waiting"], s["kv_usage"]) != late
               for s, late in zip(steps, after_update)) > 0
    # All requests were added up front: only after the last step is the engine idle.
    assert [bool(s.get("drained")) for s in steps] == [False] * (len(steps) - 1) + [True]
    probe = "swapped" if mode == "swap" else "preempted"
    assert sum(len(s[probe]) for s in steps) > 0  # the pool really was too small
    assert sum(s["prefix_hits"] for s in steps) > 0
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert len(ring.requests) == len(specs)
    for s in specs:
        r = ring.requests[s.request_id]
        assert r["output_len"] == s.output_len and r["first_token"] <= r["finished"]
    decodes = sum(e["decode"] for st in steps for e in st["reqs"])
    assert decodes >= sum(s.output_len - 1 for s in specs)


def test_llm_trace_has_one_record_per_step_with_phases(tiny_llama_path, tmp_path):
    """LLM(step_trace=...): one step record per step that ran, phases (schedule, prepare,
    forward, sample, update, output) summing to at most the step's wall time; request lines;
    the Chrome form next to it loads back with the same steps."""
    from tokenweir import LLM

    path = tmp_path / "run.jsonl"
    llm = LLM(model=tiny_llama_path, dtype="float32", device="cpu", step_trace=str(path),
              num_gpu_blocks_override=20, max_model_len=256, max_num_batched_tokens=64)
    engine = llm.llm_engine
    ran = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda now=0.0: ran.append(schedule(now)) or ran[-1]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * k) % 300 + 20 for k in range(40 + 8 * i)]}
               for i in range(6)]  # 360 prompt tokens + 240 outputs > 19 blocks of 16
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    engine.close()
    trace = load_jsonl(path)
    assert len(trace.steps) == sum(1 for out in ran if not out.is_empty) > 10
    assert trace.meta["source"] == "engine" and trace.meta["num_gpu_blocks"] == 20
    assert trace.meta["num_layers"] == 2  # the tiny Llama's: where a simulated cut can fall
    for s in trace.steps:
        assert set(s["phases"]) == REAL_PHASES
        assert sum(s["phases"].values()) <= s["duration"] * (1 + 1e-9)
        assert sum(e["prefill"] + e["decode"] for e in s["reqs"]) > 0
    for a, b in zip(trace.steps, trace.steps[1:]):
        assert b["start"] >= a["start"] + a["duration"] - 1e-9
    assert sum(len(s["preempted"]) for s in trace.steps) > 0  # 20 blocks: preemption fired
    assert len(trace.requests) == 6
    assert all(r["first_token"] <= r["finished"] and r["output_len"] == 40
               for r in trace.requests.values())
    chrome = load_chrome_trace(chrome_path_for(path))
    assert len(chrome.steps) == len(trace.steps) and len(chrome.requests) == 6
    assert [round(s["duration"], 6) for s in chrome.steps] == \
        [round(s["duration"], 6) for s in trace.steps]


def test_generate_cli_writes_a_trace(tiny_llama_path, tmp_path, capsys):
    from tokenweir.cli import main

    path = tmp_path / "gen.jsonl"
    assert main(["generate", "--model", tiny_llama_path, "--dtype", "float32", "--no-chat",
                 "--prompt", "a b c", "--prompt", "d e f g", "--max-tokens", "5",
                 "--trace", str(path)]) == 0
    trace = load_jsonl(path)
    assert trace.steps and len(trace.requests) == 2
    assert all(set(s["phases"]) == REAL_PHASES for s in trace.steps)
    with open(chrome_path_for(path)) as f:
        events = json.load(f)["traceEvents"]
    assert {e["name"] for e in events if e.get("cat") == "phase"} == REAL_PHASES


def test_tracing_costs_under_two_percent_of_step_time(make_llm, tmp_path):
    """The tracer's own time (observer call, output hook, JSON line) per step, against the
    step's wall time, on the default model. Printed; asserted < 2%."""
    llm = make_llm(step_trace=str(tmp_path / "o.jsonl"), max_num_batched_tokens=128)
    engine = llm.llm_engine
    tracer, spent = engine.tracer, [0.0]

    def timed(fn):
        def call(*args):
            started = time.perf_counter()
            fn(*args)
            spent[0] += time.perf_counter() - started
        return call

    engine.core.step_observers[engine.core.step_observers.index(tracer)] = timed(tracer)
    tracer.output_processed = timed(tracer.output_processed)
    prompts = [f"Count from {i} to {i + 20}." for i in range(8)]
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - started
    engine.close()
    steps = load_jsonl(tmp_path / "o.jsonl").steps
    share = spent[0] / sum(s["duration"] for s in steps)
    print(f"\ntracing overhead: {1e6 * spent[0] / len(steps):.0f} us per step, "
          f"{100 * share:.3f}% of step time ({len(steps)} steps, {wall:.1f} s)")
    assert share < 0.02
