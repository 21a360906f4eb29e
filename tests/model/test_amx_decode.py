"""Bfloat16 matmuls of up to layers.AMX_MAX_ROWS rows on the AMX kernel: they go to it through
Linear.forward, Linear.bind and the LM head's path (layers.bucketed_linear), unpadded; more rows,
a bias and TOKENWEIR_AMX_LINEAR=0 go to oneDNN. At 1-16 rows its rows are oneDNN's bits on
SmolLM2's shapes; above, within bfloat16 rounding of them, and a row's bits do not depend on the
other rows. The whole model on it: tests/model/test_onednn_packed.py's greedy test."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import count_amx_rows  # tests/model/kernel_paths.py

from tokenweir.model import kernels, layers
from tokenweir.model.layers import AMX_MAX_ROWS, Linear

pytestmark = pytest.mark.skipif(kernels.amx_linear_kernel() is None,
                                reason="needs the AMX kernel (AMX-BF16 and the C++ kernels)")

SMOLLM2_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down


def _linear(n: int, k: int, bias: bool = False) -> Linear:
    lin = Linear(k, n, bias=bias, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(n + k)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture
def amx_calls(monkeypatch):
    """The rows of every call the AMX kernel gets (the probe that the path really ran)."""
    return count_amx_rows(monkeypatch)


def _onednn(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return layers.onednn_linear(x, layers.onednn_pack(lin.weight.detach()), lin.bias)


@torch.inference_mode()
@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
def test_decode_rows_take_the_amx_kernel_with_onednns_bits(n, k, amx_calls):
    lin = _linear(n, k)
    for rows in (1, 2, 7, 16):
        x = _rows(rows, k, rows)
        assert torch.equal(lin(x), _onednn(lin, x)), rows
    assert amx_calls == [1, 2, 7, 16]


@torch.inference_mode()
def test_up_to_the_limit_unpadded_and_a_row_alone_is_the_same_bits(amx_calls):
    lin = _linear(3072, 576)
    row = _rows(1, 576, 0)
    alone = lin(row)[0]
    for rows in (17, 25, AMX_MAX_ROWS):
        x = _rows(rows, 576, rows)
        x[rows // 2] = row[0]
        got = lin(x)
        torch.testing.assert_close(got, _onednn(lin, x), rtol=1e-2, atol=1e-2)
        assert torch.equal(got[rows // 2], alone), rows
    assert amx_calls == [1, 17, 25, AMX_MAX_ROWS]  # unpadded: not 18, 26


@torch.inference_mode()
def test_more_rows_and_the_switch_keep_onednn(amx_calls, monkeypatch):
    lin = _linear(576, 576)
    x = _rows(AMX_MAX_ROWS + 1, 576, 3)
    assert torch.equal(lin(x), _onednn(lin, x))
    assert amx_calls == []
    lin(x[:4])
    assert amx_calls == [4]  # the probe counts: 4 rows take the kernel with the switch on
    monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "0")
    assert torch.equal(lin(x[:4]), _onednn(lin, x[:4]))
    assert amx_calls == [4]


@torch.inference_mode()
def test_bind_takes_the_kernel_up_to_the_limit(amx_calls):
    lin = _linear(960, 576)
    x = _rows(4, 576, 4)
    assert torch.equal(lin.bind(x)(x), _onednn(lin, x))
    big = _rows(AMX_MAX_ROWS - 3, 576, 5)
    bound = lin.bind(big)  # the class of every count above 16 rows
    torch.testing.assert_close(bound(big), _onednn(lin, big), rtol=1e-2, atol=1e-2)
    bigger = _rows(AMX_MAX_ROWS + 36, 576, 6)
    assert torch.equal(bound(bigger), lin(bigger))
    assert amx_calls == [4, AMX_MAX_ROWS - 3]


@torch.inference_mode()
def test_a_bias_keeps_onednn_which_adds_it_before_rounding(amx_calls):
    lin = _linear(960, 576, bias=True)
    x = _rows(4, 576, 4)
    assert torch.equal(lin(x), _onednn(lin, x))
    assert torch.equal(lin.bind(x)(x), _onednn(lin, x))
    assert amx_calls == []


@torch.inference_mode()
def test_the_lm_heads_path_takes_the_kernel(amx_calls):
    """compute_logits' bfloat16 path is bucketed_linear with the model as owner."""
    owner = type("Owner", (), {})()
    weight = _rows(49152 // 16, 576, 6)
    hidden = _rows(3, 576, 7)
    got = layers.bucketed_linear(hidden, weight, owner=owner)
    assert torch.equal(got, layers.onednn_linear(hidden, layers.onednn_pack(weight), None))
    assert amx_calls == [3]
