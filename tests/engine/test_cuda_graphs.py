"""Decode CUDA graphs (runner/cuda_graphs.py). On every machine: the bucket choice, and the
padded static-buffer forward giving the unpadded forward's rows and K/V (padding rows touch
only the null block). On CUDA: graph replays equal eager decode steps, step after step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenweir.model.attention import build_attention_metadata
from tokenweir.model.backends import select_backend
from tokenweir.runner.cuda_graphs import (DEFAULT_BUCKETS, DecodeGraphs, StaticDecodeBuffers,
                                          bucket_for)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from paged_driver import PagedDriver  # noqa: E402
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

from tokenweir.model.loader import load_model  # noqa: E402

PROMPTS = {"a": [5, 9, 33, 7, 100, 3], "b": list(range(40, 61)), "c": [8, 8]}


def test_bucket_for():
    assert [bucket_for(n, DEFAULT_BUCKETS) for n in (1, 3, 8, 9, 33, 512)] == \
        [1, 4, 8, 16, 48, 512]
    assert bucket_for(513, DEFAULT_BUCKETS) is None


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-graphs")
    make_tiny_model("llama", str(path), seed=4)
    return str(path)


def _prefilled(path: str, device: str, backend):
    loaded = load_model(path, torch.float32, torch.device(device))
    driver = PagedDriver(loaded.model, loaded.arch, block_size=4, num_blocks=64, device=device,
                         backend=backend)
    for rid, prompt in PROMPTS.items():
        driver.add(rid, prompt)
    driver.step([(rid, len(p)) for rid, p in PROMPTS.items()])
    for rid in PROMPTS:
        driver.append(rid, 11)
        driver._reserve(driver.seqs[rid], len(driver.seqs[rid].tokens))
    return loaded, driver


def _decode_inputs(driver):
    seqs = [driver.seqs[r] for r in PROMPTS]
    return ([s.tokens[-1] for s in seqs], [len(s.tokens) - 1 for s in seqs],
            [list(s.blocks) for s in seqs])


@pytest.mark.parametrize("backend_name", ["cpu", "reference"])
@torch.inference_mode()
def test_padded_static_forward_equals_unpadded(tiny_path, backend_name):
    backend = select_backend("cpu", backend_name)
    loaded, driver = _prefilled(tiny_path, "cpu", backend)
    ids, positions, tables = _decode_inputs(driver)
    before = [c.clone() for c in driver.kv_caches]
    meta = build_attention_metadata([1] * 3, positions, tables, 4, "cpu", backend)
    eager = loaded.model(torch.tensor(ids), torch.tensor(positions), meta, driver.kv_caches)
    eager_caches = [c.clone() for c in driver.kv_caches]
    for cache, saved in zip(driver.kv_caches, before):
        cache.copy_(saved)
    buffers = StaticDecodeBuffers(8, 16, 4, torch.device("cpu"), group=2)
    seq_lens = buffers.fill(ids, positions, tables, bucket=8)
    static_meta = buffers.metadata(8, seq_lens, backend)
    padded = loaded.model(buffers.input_ids[:8], buffers.positions[:8], static_meta,
                          driver.kv_caches)
    assert padded.shape[0] == 8  # probe: five padding rows ran
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for got, want, saved in zip(driver.kv_caches, eager_caches, before):
        # live blocks: equal up to rounding (8-row GEMMs round unlike 3-row ones)
        torch.testing.assert_close(got[:, 1:], want[:, 1:], rtol=1e-4, atol=1e-5)
        assert not torch.equal(got[:, 0], saved[:, 0])  # probe: padding wrote the null block


@pytest.mark.cuda
@torch.inference_mode()
def test_cuda_graph_replays_equal_eager_steps(tiny_path):
    backend = select_backend("cuda", "triton")
    loaded, driver = _prefilled(tiny_path, "cuda", backend)
    _, eager_driver = _prefilled(tiny_path, "cuda", backend)
    group = loaded.arch.num_heads // loaded.arch.num_kv_heads
    graphs = DecodeGraphs(loaded.model, driver.kv_caches, backend, 4, 16, group,
                          buckets=(1, 2, 4, 8))
    for _ in range(5):
        ids, positions, tables = _decode_inputs(driver)
        hidden = graphs.run(ids, positions, tables)
        want = eager_driver.step([(r, 1) for r in PROMPTS])
        logits = loaded.model.compute_logits(hidden).float()
        for row, rid in enumerate(PROMPTS):
            torch.testing.assert_close(logits[row], want[rid].float(), rtol=1e-4, atol=1e-4)
            token = int(want[rid].argmax())
            seq = driver.seqs[rid]
            seq.num_computed = len(seq.tokens)  # the replay computed the last token's K/V
            driver.append(rid, token)
            driver._reserve(seq, len(seq.tokens))
            eager_driver.append(rid, token)  # its step() advanced num_computed itself
    assert graphs.replays == 5 and set(graphs.graphs) == {4}  # probe: replayed, one capture


def test_fill_padding_only_rows_touch_the_null_block():
    """capture_all fills buckets with padding rows alone: each a 1-token 'decode' of the null
    block (slot 0, context 1, table entry 0), whatever stale rows the buffers held."""
    buffers = StaticDecodeBuffers(8, 6, 4, torch.device("cpu"))
    buffers.fill([3, 4], [9, 2], [[5, 6, 7], [8]], bucket=2)  # live rows first
    assert buffers.fill([], [], [], bucket=4) == []
    assert buffers.input_ids[:4].tolist() == [0] * 4 and buffers.slot_mapping[:4].tolist() == [0] * 4
    assert buffers.seq_lens[:4].tolist() == [1] * 4
    assert buffers.block_tables[:4, 0].tolist() == [0] * 4  # stale entries past it unread
    with pytest.raises(ValueError, match="exceeds"):
        buffers.fill([1], [0], [[1] * 7], bucket=1)


@pytest.fixture(scope="module")
def tiny_engine_path(tmp_path_factory) -> str:
    """The tiny model with a tokenizer (the engine needs one; the drivers above do not)."""
    path = tmp_path_factory.mktemp("tiny-graphs-engine")
    make_tiny_model("llama", str(path), seed=4)
    save_tiny_tokenizer(str(path), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return str(path)


@pytest.mark.cuda
def test_engine_captures_every_bucket_at_start_and_replays_them(tiny_engine_path,
                                                                 monkeypatch):
    """With the warm-up on, the engine captures each decode bucket up to max_num_seqs before
    serving; serving then replays without a new capture (probe: replays > 0, same buckets),
    and the tokens equal the graphs-off engine's."""
    from tokenweir import LLM, SamplingParams
    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS.values()]
    llm = LLM(tiny_engine_path, dtype="float32", device="cuda", max_num_seqs=8,
              max_model_len=128)
    graphs = llm.llm_engine.core.executor.graphs
    assert set(graphs.graphs) == {1, 2, 4, 8}
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphs.replays > 0 and set(graphs.graphs) == {1, 2, 4, 8}
    monkeypatch.setenv("TOKENWEIR_CUDA_GRAPHS", "0")
    eager = LLM(tiny_engine_path, dtype="float32", device="cuda", max_num_seqs=8,
                max_model_len=128)
    assert eager.llm_engine.core.executor.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_a_failed_start_up_capture_turns_graphs_off(caplog):
    """capture_decode_graphs: a capture that raises leaves the runner eager (graphs None,
    logged), never a failed start (probe: the stand-in capture really raised)."""
    from tokenweir.runner.model_runner import ModelRunner
    calls = []

    class Broken:
        def capture_all(self, max_batch):
            calls.append(max_batch)
            raise RuntimeError("capture failed")
    runner = ModelRunner.__new__(ModelRunner)
    runner.graphs = Broken()
    assert runner.capture_decode_graphs(8) == 0
    assert calls == [8] and runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text
    assert runner.capture_decode_graphs(8) == 0  # graphs off: nothing to capture


def test_batch_invariant_graph_metadata_takes_the_plan_of_every_invariant_step():
    """In batch-invariant mode a captured decode step must run the tile shape that
    triton_paged.plan_step gives every step in that mode (a decode-only plan would put the
    rows in 16-row tiles, another compiled kernel)."""
    from tokenweir.model.backends import triton_paged
    from tokenweir.model.attention import build_attention_metadata
    buffers = StaticDecodeBuffers(8, 6, 4, torch.device("cpu"), group=3)
    backend = type("Triton", (), {"name": "triton"})()
    invariant = buffers.metadata(4, [5, 6], backend, invariant=True)
    eager = build_attention_metadata([1] * 4, [4, 5, 0, 0], [[1, 2]] * 4, 4, "cpu",
                                     batch_invariant=True)
    planned = triton_paged.plan_step(eager, 3, torch.device("cpu"))
    assert invariant.batch_invariant
    plan = invariant.backend_plan
    assert (plan.block_m, plan.block_q) == (planned.block_m, planned.block_q)
    default = buffers.metadata(4, [5, 6], backend).backend_plan
    assert (default.block_m, default.block_q) != (plan.block_m, plan.block_q)  # probe
