"""Weight-only int8 decode matmuls (quantization="int8", layers.int8_matmul): per output channel
symmetric weights; a bfloat16 batch of <= INT8_MAX_ROWS rows on CPU runs on the int8 copy, every
other matmul stays unquantized. Each test probes which path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_paths import random_linear
from tokenweir.config import EngineConfig, ModelConfig, ParallelConfig
from tokenweir.engine.llm_engine import check_quantization
from tokenweir.model import layers


def test_quantize_int8_is_within_half_a_step_per_weight():
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.linspace(0.01, 3, 40)[:, None]  # rows of unlike scales
    q, scales = layers.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (40,) and int(q.abs().max()) == 127
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()


@torch.inference_mode()
def test_int8_rows_are_close_and_only_few_bf16_rows_take_it(int8_calls):
    lin = random_linear(96, 200, True, seed=3).to(torch.bfloat16)
    layers.set_quantization(lin, "int8")
    for rows in range(1, layers.INT8_MAX_ROWS + 2):
        x = torch.randn(rows, 96).bfloat16()
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        got = lin(x).float()
        # int8 steps are max|w_row| / 127 (~2.5% of a row's largest weight for normal rows)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item() + 0.3
    assert int8_calls == list(range(1, layers.INT8_MAX_ROWS + 1))  # rows 5+: unquantized
    lin.float()(torch.randn(2, 96))  # float32: unquantized (it measured slower)
    layers.set_quantization(lin, None)
    lin.bfloat16()(torch.randn(2, 96).bfloat16())
    assert int8_calls == list(range(1, layers.INT8_MAX_ROWS + 1))


@torch.inference_mode()
def test_int8_needs_k_a_multiple_of_32(int8_calls):
    lin = random_linear(40, 16, False, seed=4).to(torch.bfloat16)  # K = 40: torch's op errs
    layers.set_quantization(lin, "int8")
    x = torch.randn(2, 40).bfloat16()
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    assert int8_calls == []


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from tiny_models import load_tiny

    return load_tiny(tmp_path_factory, "llama_tied", 13, torch.bfloat16)


@torch.no_grad()
def test_model_decodes_on_int8_close_to_unquantized(tiny_bf16, int8_calls):
    """The paged forward of a tiny model, quantized vs not: batch-1 decodes (and the tied LM
    head) run on int8, the prompt chunks do not; logits stay within the int8 error."""
    from paged_driver import PagedDriver, run_greedy

    model, arch = tiny_bf16.model, tiny_bf16.arch
    prompts = {"a": [5, 9, 33, 7, 100, 4, 8, 60, 61, 62]}
    runs = {}
    try:
        for quantization in (None, "int8"):
            layers.set_quantization(model, quantization)
            driver = PagedDriver(model, arch, block_size=4, dtype=torch.bfloat16)
            runs[quantization] = run_greedy(driver, prompts, 5)
    finally:
        layers.set_quantization(model, None)
    assert int8_calls and set(int8_calls) == {1}  # probe: decodes took it, prefill (10) not
    for (rid, n, got), (_, _, want) in zip(runs["int8"][1], runs[None][1]):
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() < 0.1 * scale, (rid, n)


def test_quantization_is_refused_where_it_does_not_run():
    cpu = torch.device("cpu")
    config = EngineConfig(model=ModelConfig(quantization="int8"))
    check_quantization(config, cpu, torch.bfloat16)  # accepted
    with pytest.raises(ValueError, match="bfloat16"):
        check_quantization(config, cpu, torch.float32)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization(config, torch.device("cuda"), torch.bfloat16)
    tp = EngineConfig(model=ModelConfig(quantization="int8"),
                      parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="one process"):
        check_quantization(tp, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int4").validate()
