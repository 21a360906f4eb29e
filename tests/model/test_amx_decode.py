"""Decode-sized bfloat16 matmuls on the AMX kernel (layers.AMX_DECODE_MAX_ROWS): 1-16 rows go
to it through Linear.forward, Linear.bind and the LM head's path (layers._linear), more rows and
TOKENWEIR_AMX_LINEAR=0 to oneDNN; on SmolLM2's shapes its rows are oneDNN's bits. The whole
model on it: tests/model/test_onednn_packed.py's greedy test."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model import kernels, layers
from tokenweir.model.layers import Linear

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


@pytest.fixture
def amx_calls(monkeypatch):
    """The rows of every call the AMX kernel gets (the probe that the path really ran); the
    kernel's getter still reads TOKENWEIR_AMX_LINEAR."""
    real_getter = kernels.amx_linear_kernel
    rows: list[int] = []

    def getter():
        kernel = real_getter()
        if kernel is None:
            return None

        def counting(x, tiles, n, float_out=False):
            rows.append(x.shape[0])
            return kernel(x, tiles, n, float_out)
        return counting
    monkeypatch.setattr(kernels, "amx_linear_kernel", getter)
    return rows


def _onednn(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return layers.onednn_linear(x, layers.onednn_pack(lin.weight.detach()), lin.bias)


@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
def test_decode_rows_take_the_amx_kernel_with_onednns_bits(n, k, amx_calls):
    lin = _linear(n, k)
    for rows in (1, 2, 7, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        with torch.no_grad():
            assert torch.equal(lin(x), _onednn(lin, x)), rows
    assert amx_calls == [1, 2, 7, 16]


def test_more_rows_and_the_switch_keep_onednn(amx_calls, monkeypatch):
    lin = _linear(576, 576)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        assert torch.equal(lin(x), _onednn(lin, x))
        assert amx_calls == []
        lin(x[:4])
        assert amx_calls == [4]  # the probe counts: 4 rows take the kernel with the switch on
        monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "0")
        assert torch.equal(lin(x[:4]), _onednn(lin, x[:4]))
    assert amx_calls == [4]


def test_bind_takes_the_kernel_for_decode_rows_only(amx_calls):
    lin = _linear(960, 576)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        assert torch.equal(lin.bind(x)(x), _onednn(lin, x))
        assert amx_calls == [4]
        big = torch.randn(40, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
        lin.bind(big)(big)
    assert amx_calls == [4]


def test_a_bias_keeps_onednn_which_adds_it_before_rounding(amx_calls):
    lin = _linear(960, 576, bias=True)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        assert torch.equal(lin(x), _onednn(lin, x))
        assert torch.equal(lin.bind(x)(x), _onednn(lin, x))
    assert amx_calls == []


def test_the_lm_heads_path_takes_the_kernel(amx_calls):
    """compute_logits' bfloat16 path is bucketed_linear with the model as owner."""
    owner = type("Owner", (), {})()
    weight = torch.randn(49152 // 16, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = layers.bucketed_linear(hidden, weight, owner=owner)
    assert torch.equal(got, layers.onednn_linear(hidden, layers.onednn_pack(weight), None))
    assert amx_calls == [3]

