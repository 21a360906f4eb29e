"""Mid-forward cuts through the real runner: a cut step rolls back as if it never ran (every
output identical to an uncut run), a stale order never cuts a later step, and the monitor
thread really cuts a real-model prefill for an urgent arrival. Each test probes that the cut
(or the refusal) really happened."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams
from tokenweir.core.outputs import SLO_MID_STEP
from tokenweir.engine.slo_monitor import SLOMonitor
from tokenweir.runner.interrupt import CutOrder, CutSignal

from tests.engine.conftest import needs_smollm2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

CHATML = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TINY = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8,
            max_num_batched_tokens=48, long_prefill_token_threshold=32,
            num_gpu_blocks_override=200, scheduling_policy="slo", slo_mid_step_cut=False,
            slo_ttft_a_ms_per_token=1.0, slo_ttft_c_ms=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-slo")
    make_tiny_model("llama", str(path), seed=5)
    save_tiny_tokenizer(str(path), CHATML)
    return str(path)


def _prompts(n: int = 6, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randint(20, 150))]}
            for _ in range(n)]


class LateSignal(CutSignal):
    """Sees its order only from layer `from_layer` on: the monitor 'wrote it mid-forward',
    so the layers before really ran and wrote K/V that the rollback must discard."""

    def __init__(self, num_layers: int, from_layer: int) -> None:
        super().__init__(num_layers, layer_fraction=0.9)
        self.from_layer = from_layer
        self.consulted = 0

    def order_for(self, step_id: int, layer_index: int):
        self.consulted += 1
        if layer_index < self.from_layer:
            return None
        return super().order_for(step_id, layer_index)


def _cutting_runner(llm: LLM, signal: CutSignal, cut_steps: set[int], reports: list):
    """Make the runner obey `signal`, and write an order for every step in `cut_steps` that
    carries a prefill chunk (the victim); records every CutReport."""
    runner = llm.llm_engine.core.executor
    runner.cut_signal = signal
    execute = runner.execute

    def wrapped(out):
        prefills = [r for r, n in out.num_scheduled_tokens.items() if n > 1]
        if out.step_id in cut_steps and prefills:
            signal.order(CutOrder(out.step_id, prefills[0], "test", 0.0))
        result = execute(out)
        if result.cut is not None:
            reports.append(result.cut)
        return result

    runner.execute = wrapped


def test_cut_tiny_model_outputs_identical_to_uncut(tiny_llama):
    baseline = LLM(tiny_llama, **TINY).generate(_prompts(), PARAMS, use_tqdm=False)
    llm = LLM(tiny_llama, **TINY)
    signal, reports = LateSignal(num_layers=2, from_layer=1), []
    _cutting_runner(llm, signal, {1, 3, 4, 8}, reports)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats
    # probe: cuts really happened, after layer 0 had run
    assert len(reports) >= 2 and stats.preemptions_by_cause[SLO_MID_STEP] == len(reports)
    assert all(r.layer_index == 1 and r.num_layers == 2 for r in reports)
    assert stats.slo_wasted_layer_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in baseline]


def test_layer_fraction_refuses_a_late_cut(tiny_llama):
    llm = LLM(tiny_llama, **TINY)
    late = LateSignal(2, from_layer=1)  # the order shows up only before layer 1 of 2 ...
    late.layer_fraction = 0.4  # ... which is past the fraction: only layer 0 may be cut
    reports: list = []
    _cutting_runner(llm, late, {1, 3}, reports)
    llm.generate(_prompts(3), PARAMS, use_tqdm=False)
    assert late.consulted > 0  # probe: the hook was asked at every boundary
    assert reports == [] and llm.llm_engine.scheduler.stats.slo_cut_steps == 0


def test_stale_target_step_never_cuts_a_later_step(tiny_llama):
    """The scripted race: the monitor reads the snapshot of step N after N has finished and
    orders N cut; step N+1 runs in full. A positive control shows the same monitor's order
    does cut the step it names."""
    kwargs = dict(TINY, slo_ttft_a_ms_per_token=1000.0)  # 48-token steps "take" 48 s
    llm = LLM(tiny_llama, **kwargs)
    engine = llm.llm_engine
    runner = engine.core.executor
    signal = CutSignal(num_layers=2, layer_fraction=0.9)
    runner.cut_signal = signal
    monitor = SLOMonitor(engine.scheduler.policy, signal, engine.core.pending_arrivals,
                         engine.core.clock)
    long_req, text = engine.make_request({"prompt_token_ids": list(range(3, 203))}, PARAMS)
    engine.add_request(long_req, text)
    engine.step()  # step N: a prefill chunk of the long request
    stale_id = engine.scheduler.policy.slo_snapshot.step_id
    urgent, text = engine.make_request({"prompt_token_ids": list(range(5, 15))}, PARAMS,
                                       ttft_slo_ms=20_000.0)  # 10 s of work, 20 s to go
    engine.submit_request(urgent, text)
    order = monitor.check_once(engine.core.clock())  # the race: step N is already over
    assert order is not None and order.step_id == stale_id  # probe: the gate did fire
    engine.step()  # step N+1
    assert engine.scheduler.stats.slo_cut_steps == 0
    assert engine.scheduler.policy.slo_snapshot.step_id == stale_id + 1
    # positive control: an order naming the step in flight cuts it
    signal.order(CutOrder(stale_id + 2, long_req.request_id, urgent.request_id, 0.0))
    engine.step()
    assert engine.scheduler.stats.slo_cut_steps == 1


@needs_smollm2
def test_monitor_thread_cuts_a_real_model_prefill(make_llm):
    """The real model (30 layers): an urgent request arrives while an 800-token prefill
    runs; the monitor thread orders the cut, the runner unwinds at a layer boundary, and every
    output equals the uncut run's."""
    # A pessimistic predictor (5 ms/token): the step in flight "lasts" ~4 s, so the gate fires
    # even when a busy machine delays the monitor's look by a second or more.
    common = dict(max_num_batched_tokens=2048, enable_prefix_caching=True,
                  num_gpu_blocks_override=160, scheduling_policy="slo",
                  slo_ttft_a_ms_per_token=5.0, slo_ttft_c_ms=10.0)
    rng = random.Random(3)
    long_prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(800)]}
    short_prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(40)]}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    uncut = make_llm(**common, slo_mid_step_cut=False)
    expected = [o.outputs[0].token_ids
                for o in uncut.generate([long_prompt, short_prompt], params, use_tqdm=False)]

    llm = make_llm(**common)
    engine = llm.llm_engine
    long_req, _ = engine.make_request(long_prompt, params)
    urgent, _ = engine.make_request(short_prompt, params, ttft_slo_ms=1000.0)
    engine.add_request(long_req, None)

    def submit_when_the_prefill_runs() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = engine.scheduler.policy.slo_snapshot
            if snap is not None and snap.prefills:
                break
            time.sleep(0.001)
        time.sleep(0.02)
        urgent.arrival_time = engine.core.clock()
        engine.submit_request(urgent, None)

    feeder = threading.Thread(target=submit_when_the_prefill_runs)
    feeder.start()
    results = {}
    try:
        while len(results) < 2:
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
    finally:
        feeder.join()
        engine.shutdown()
    stats = engine.scheduler.stats
    assert engine.slo_monitor.num_orders >= 1  # probe: the monitor ordered
    assert stats.slo_cut_steps >= 1 and stats.preemptions_by_cause[SLO_MID_STEP] >= 1
    assert 0 <= stats.slo_wasted_layer_tokens < stats.slo_total_layer_tokens  # cut before 0.9
    assert [results[long_req.request_id], results[urgent.request_id]] == expected


@needs_smollm2
def test_async_engine_arrival_cuts_the_step_in_flight(make_llm):
    """The serving path: AsyncEngine.add hands a request to the engine's inbox at once (not
    between steps), so an urgent request that arrives over HTTP while an 800-token prefill
    runs gets that step cut. Probes: the step in flight was still running when the request
    was added, and the mid-step cut counter moved."""
    import asyncio

    from tokenweir.engine.async_engine import AsyncEngine

    rng = random.Random(4)
    long_prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(800)]}
    short_prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(40)]}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = make_llm(max_num_batched_tokens=2048, num_gpu_blocks_override=160,
                   scheduling_policy="slo", slo_ttft_a_ms_per_token=5.0, slo_ttft_c_ms=10.0)
    engine = llm.llm_engine
    front = AsyncEngine(engine)

    async def main() -> tuple[list[int], list[int], int]:
        front.start()
        long_queue = await front.add(long_prompt, params, "long")
        while not (engine.scheduler.policy.slo_snapshot and engine.scheduler.policy.slo_snapshot.prefills):
            await asyncio.sleep(0.001)
        in_flight = engine.scheduler.policy.slo_snapshot.step_id
        await asyncio.sleep(0.02)
        short_queue = await front.add(short_prompt, params, "urgent", ttft_slo_ms=1000.0)
        step_when_added = engine.scheduler.policy.slo_snapshot.step_id
        waits_in_inbox = [r.request_id for r in engine.core.pending_arrivals()]
        outs = []
        for name, queue in (("long", long_queue), ("urgent", short_queue)):
            tokens = []
            async for out in front.stream(name, queue):
                tokens.extend(out.outputs[0].token_ids)
            outs.append(tokens)
        return outs[0], outs[1], step_when_added - in_flight, waits_in_inbox

    try:
        long_tokens, urgent_tokens, steps_between, waits_in_inbox = asyncio.run(main())
    finally:
        front.shutdown()
        engine.shutdown()
    # probe: the request arrived while the prefill step ran, and waited in the inbox (where
    # the monitor sees it) rather than for the step to end
    assert steps_between == 0 and waits_in_inbox == ["urgent"]
    stats = engine.scheduler.stats
    assert stats.preemptions_by_cause[SLO_MID_STEP] >= 1 and stats.slo_cut_steps >= 1
    assert len(long_tokens) == 3 and len(urgent_tokens) == 3


def test_monitor_wakes_on_an_arrival_not_only_on_its_poll():
    """With a one-minute poll the monitor looks only when woken (the engine core wakes it on
    each submitted request); probe: its look counter moves after the wake and not before."""
    from types import SimpleNamespace

    monitor = SLOMonitor(SimpleNamespace(slo_snapshot=None), CutSignal(2, 0.9), lambda: [],
                         poll_seconds=60.0).start()
    try:
        time.sleep(0.05)
        assert monitor.num_checks == 0
        monitor.wake.set()
        deadline = time.monotonic() + 5
        while monitor.num_checks == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert monitor.num_checks == 1
    finally:
        monitor.stop()
    assert not monitor._thread.is_alive()  # stop() wakes it out of the long wait


def test_monitor_polls_only_while_a_step_it_may_cut_is_the_latest():
    """Through a decode-only step the monitor sleeps (each look takes the GIL from the engine
    thread); `step_scheduled` for a step with a prefill chunk wakes it at once, and it polls
    while that step is the latest. Probe: the same monitor, same poll period, polls as soon
    as the snapshot has a prefill."""
    from types import SimpleNamespace

    def snapshot(step_id: int, prefills: tuple) -> SimpleNamespace:
        return SimpleNamespace(step_id=step_id, prefills=prefills, waiters=(),
                               predicted_seconds=1.0, started_at=time.monotonic())

    policy = SimpleNamespace(slo_snapshot=snapshot(1, ()),
                             slo_decide=lambda *a: (SimpleNamespace(fire=False), None))
    monitor = SLOMonitor(policy, CutSignal(2, 0.9), lambda: [], poll_seconds=0.005).start()

    def checks_after(seconds: float) -> int:
        time.sleep(seconds)
        return monitor.num_checks

    try:
        monitor.step_scheduled()  # decodes only: no wake, no polls
        assert checks_after(0.1) == 0
        policy.slo_snapshot = snapshot(2, ("a prefill",))
        monitor.step_scheduled()
        deadline = time.monotonic() + 5
        while monitor.num_checks < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert monitor.num_checks >= 5  # probe: polling every 5 ms now
        policy.slo_snapshot = snapshot(3, ())
        settled = checks_after(0.2)  # at most the poll already due looks again
        assert checks_after(0.1) == settled
    finally:
        monitor.stop()
