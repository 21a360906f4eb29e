"""The fused layer ops (residual add + RMSNorm, SiLU x up, in-place rotary) against the torch
ops they replace: float32 to rounding, bfloat16 to one bfloat16 step (they round where the
torch ops round). Each test also runs the torch fallback (kernels off) and checks which ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_paths import force_path
from tokenweir.model import layers

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
PATHS = pytest.mark.parametrize("path", ["torch", "avx2"])


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    scale = max(1.0, b.float().abs().max().item())
    assert (a.float() - b.float()).abs().max().item() <= ATOL[dtype] * scale


@DTYPES
@PATHS
def test_add_rmsnorm(dtype, path, monkeypatch):
    calls = force_path(path, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    norm = layers.RMSNorm(96, 1e-5, dtype=dtype)
    norm.weight.data = torch.rand(96, generator=gen).to(dtype) + 0.5
    x, res = (torch.randn(37, 96, generator=gen).to(dtype) for _ in range(2))
    expected_sum = x + res
    expected = norm(expected_sum)
    residual = res.clone()
    got = norm.add_forward(x, residual)
    assert torch.equal(residual, expected_sum)  # the running sum, updated in place
    _close(got, expected, dtype)
    _close(norm.add_forward(None, residual.clone()), expected, dtype)
    assert calls["add_rmsnorm"] == (2 if path != "torch" else 0)


@DTYPES
@PATHS
def test_silu_mul(dtype, path, monkeypatch):
    calls = force_path(path, monkeypatch)
    gate_up = torch.randn(21, 2 * 80, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    _close(layers.silu_mul(gate_up), F.silu(gate) * up, dtype)
    assert calls["silu_mul"] == (1 if path != "torch" else 0)


@DTYPES
@PATHS
def test_rotary_in_place_on_the_fused_qkv(dtype, path, monkeypatch):
    """Rotates the leading q and k heads of a [T, q+k+v heads, D] tensor in place, leaves v."""
    calls = force_path(path, monkeypatch)
    rope = layers.RotaryEmbedding(64, 300, 1e5, None)
    positions = torch.tensor([0, 5, 299, 17, 42])
    qkv = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    step = rope.for_step(positions, dtype)
    expected = layers.apply_rotary(qkv[:, :5], *rope(positions, dtype))
    got = qkv.clone()
    step.rotate_leading_heads_(got, 5)
    _close(got[:, :5], expected, dtype)
    assert torch.equal(got[:, 5:], qkv[:, 5:])
    assert calls["rotary_inplace"] == (1 if path != "torch" else 0)
