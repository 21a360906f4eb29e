"""Tensor parallelism on CPU (gloo, 2 processes): TP=2 equals TP=1, and the collective cut
vote unwinds every rank before the same layer, whichever rank votes, without hanging.

Every multi-process test is bounded: the group has a timeout (tp_driver.TIMEOUT_S), and each
blocking call runs under `bounded` so a hang fails the test instead of stalling the suite. Executors are closed in
fixture teardown (workers are killed if they do not exit), so no process outlives a test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenweir.config import EngineConfig
from tokenweir.engine.llm import LLM
from tokenweir.engine.llm_engine import LLMEngine
from tokenweir.model.arch import ArchConfig
from tokenweir.model.loader import load_model
from tokenweir.parallel.sharding import shard_arch
from tokenweir.parallel.vote import VoteOnce, never_cut
from tokenweir.request import SamplingParams
from tokenweir.runner.interrupt import CutOrder, CutSignal
from tokenweir.runner.model_runner import ModelRunner
from tp_driver import BLOCK_SIZE, NUM_BLOCKS, START_BOUND_S, TIMEOUT_S, bounded, run_workload

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=256, block_size=BLOCK_SIZE,
                   num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=24,
                   long_prefill_token_threshold=16)


@pytest.fixture(scope="module")
def loaded(tiny_llama_path):
    return load_model(tiny_llama_path, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(loaded):
    """TP=1: the single-process runner on the same workload."""
    runner = ModelRunner(loaded.model, loaded.arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
                         torch.device("cpu"), frozenset({2}))
    tokens, records, cuts, _ = run_workload(runner)
    assert not cuts
    return tokens, records


@pytest.fixture(scope="module")
def tp_llm(tiny_llama_path):
    """An LLM with tensor_parallel_size=2; its executor also serves the vote tests."""
    config = EngineConfig.from_kwargs(model=tiny_llama_path, tensor_parallel_size=2,
                                      distributed_timeout=TIMEOUT_S, **ENGINE_ARGS)
    engine = bounded(lambda: LLMEngine(config), START_BOUND_S)
    try:
        yield LLM.from_engine(engine)
    finally:
        engine.close()
        for worker in engine.core.executor.workers:
            assert worker.process.poll() is not None, "a worker outlived close()"


@pytest.fixture
def executor(tp_llm):
    ex = tp_llm.llm_engine.core.executor
    yield ex
    ex.cut_signal = None
    if not ex.closed:
        ex.set_worker_should_cut(1, None)


def test_shard_arch_splits_heads_and_refuses_uneven(loaded):
    local = shard_arch(loaded.arch, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.head_dim == loaded.arch.head_dim and local.hidden_size == 64
    with pytest.raises(ValueError, match="num_kv_heads"):
        shard_arch(dataclasses.replace(loaded.arch, num_heads=6, num_kv_heads=3), 2)
    smollm2_like = dataclasses.replace(loaded.arch, num_heads=9, num_kv_heads=3,
                                       intermediate_size=1536)
    assert isinstance(shard_arch(smollm2_like, 3), ArchConfig)


def test_tp2_matches_tp1_tokens_and_logprobs(executor, reference):
    assert executor.tp_size == 2 and executor.runner.kv_caches[0].shape[3] == 1  # 1 KV head
    tokens, records, cuts, _ = bounded(lambda: run_workload(executor))
    ref_tokens, ref_records = reference
    assert not cuts and tokens == ref_tokens
    assert [(s, r) for s, r, _ in records] == [(s, r) for s, r, _ in ref_records]
    for (_, rid, lp), (_, _, ref) in zip(records, ref_records):
        assert lp.top_token_ids == ref.top_token_ids, rid
        diffs = [abs(a - b) for a, b in zip(lp.top_logprobs, ref.top_logprobs)]
        assert max(diffs) < ATOL, (rid, diffs)


def test_engine_generate_tp2_equals_tp1(tp_llm, tiny_llama_path):
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 3 * i] * (4 + 5 * i)} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tp_out = bounded(lambda: tp_llm.generate(prompts, params, use_tqdm=False))
    single = LLM(model=tiny_llama_path, **ENGINE_ARGS)
    ref_out = single.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tp_out] == [o.outputs[0].token_ids for o in ref_out]
    assert all(len(o.outputs[0].token_ids) == 8 for o in tp_out)


def _cut_summary(cuts) -> list[tuple]:
    return [(c.step_id, c.layer_index, c.victim_id, layers) for c, layers in cuts]


def test_driver_vote_cuts_both_ranks_at_the_same_layer(executor, reference):
    executor.should_cut = VoteOnce(step_id=3, layer=1)
    tokens, _, cuts, scheduler = bounded(lambda: run_workload(executor))
    assert _cut_summary(cuts) == [(3, 1, "", [1])]  # rank 0 and rank 1 both left at layer 1
    assert scheduler.stats.slo_cut_steps == 1
    assert tokens == reference[0]  # the rolled-back step and every later one ran normally


def test_one_worker_vote_cuts_the_driver_too_without_hanging(executor, reference):
    executor.should_cut = never_cut  # the driver votes 0 at every layer
    executor.set_worker_should_cut(1, VoteOnce(step_id=2, layer=0))
    tokens, _, cuts, _ = bounded(lambda: run_workload(executor))
    assert _cut_summary(cuts) == [(2, 0, "", [0])]
    assert tokens == reference[0]


def test_monitor_order_cuts_its_step_only_and_rolls_back_the_victim(executor, reference):
    """The engine's path: a CutSignal order for step 3 naming the prefilling r2 as victim."""
    signal = CutSignal(num_layers=2, layer_fraction=0.9)
    executor.cut_signal = signal
    signal.order(CutOrder(step_id=3, victim_id="r2", waiter_id="urgent", issued_at=0.0))
    tokens, _, cuts, scheduler = bounded(lambda: run_workload(executor))
    assert _cut_summary(cuts) == [(3, 0, "r2", [0])]  # the stale order cut nothing later
    assert scheduler.stats.slo_cut_steps == 1
    assert tokens == reference[0]  # r2 was preempted, recomputed, and still agrees
