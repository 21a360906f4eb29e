"""The fused CUDA ops (tokenweir/model/backends/triton_ops.py) against the torch ops they
replace in layers.py, on random data: run by Triton's interpreter on CPU, compiled on CUDA.
float32 within rounding of the mean's summation order; bfloat16 within one rounding step
(the kernels round where the torch path rounds)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tokenweir.model import layers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the dev extra has it)")

DTYPES = [torch.float32, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ops():
    from tokenweir.model.backends import triton_ops
    return triton_ops


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
           scale: torch.Tensor | None = None) -> None:
    """scale: magnitudes the error is relative to where the result cancels (default |want|)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.float().cpu(), want.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # bfloat16: within one step of bfloat16 (compiled: the kernels round to nearest, as torch
    # does, and differ only where the mean's summation order moves a rounding); Triton's
    # interpreter truncates float32 -> bfloat16 instead, so it gets four
    steps = 1 if DEVICE == "cuda" else 4
    mag = want.abs() if scale is None else torch.maximum(want.abs(), scale.float().cpu())
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - 7)
    assert ((got - want).abs() <= steps * ulp).all(), (got - want).abs().max()
    if DEVICE == "cuda":
        assert (got != want).float().mean().item() < 0.02


def _rand(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("with_x", [True, False], ids=["add", "no-add"])
def test_add_rmsnorm_matches_torch(ops, dtype, with_x):
    dim = 96  # not a power of two: the masked tail
    norm = layers.RMSNorm(dim, 1e-5).to(DEVICE, dtype)
    norm.weight.data = _rand(dim, dtype=dtype, seed=9)
    residual, x = _rand(7, dim, dtype=dtype, seed=1), _rand(7, dim, dtype=dtype, seed=2)
    want_res = residual.clone()
    if with_x:
        want_res.add_(x)
    want = _torch_norm(norm, want_res)
    got = ops.add_rmsnorm(x if with_x else None, residual, norm.weight, norm.eps)
    _close(residual, want_res, dtype)  # the residual written in place
    _close(got, want, dtype)


def _torch_norm(norm: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """layers.RMSNorm's torch path (what the CUDA model ran before the fused op)."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rmsnorm_rows_of_a_head_slice(ops, dtype):
    """The q_norm/k_norm case: a [T, heads, dim] slice of the fused qkv output."""
    t, h, kvh, d = 5, 4, 2, 32
    qkv = _rand(t, h + 2 * kvh, d, dtype=dtype, seed=3)
    weight = _rand(d, dtype=dtype, seed=4)
    norm = layers.RMSNorm(d, 1e-6).to(DEVICE, dtype)
    norm.weight.data = weight
    before = qkv.clone()
    got = ops.rmsnorm_rows(qkv[:, h:h + kvh], weight, 1e-6)
    assert torch.equal(qkv, before)  # the input is not written
    _close(got, _torch_norm(norm, qkv[:, h:h + kvh]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_silu_mul_matches_torch(ops, dtype):
    gate_up = _rand(6, 2 * 80, dtype=dtype, seed=5)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rotary_inplace_matches_torch(ops, dtype):
    t, h, kvh, d = 5, 3, 1, 24  # head_dim/2 = 12: the masked tail
    rope = layers.RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    qkv = _rand(t, h + 2 * kvh, d, dtype=dtype, seed=6)
    cos, sin = rope(positions, dtype)
    want = qkv.clone()
    want[:, :h + kvh] = layers.apply_rotary(want[:, :h + kvh], cos, sin)
    got = qkv.clone()
    ops.rotary_inplace(got, h + kvh, d, positions, rope.cos_cached, rope.sin_cached)
    assert torch.equal(got[:, h + kvh:], qkv[:, h + kvh:])  # v untouched
    # x1 * cos - x2 * sin cancels: the interpreter's truncated products err relative to them
    _close(got, want, dtype, scale=qkv.abs().amax(-1, keepdim=True).expand_as(qkv))


def test_layers_route_cuda_tensors_to_the_triton_ops(monkeypatch):
    """fused_ops_for: CUDA tensors get these ops (unless TOKENWEIR_CUDA_FUSED_OPS=0), CPU ones
    the C++ ops (or None); probed without a GPU through a stand-in tensor device."""
    from tokenweir.model.backends import triton_ops

    class FakeCuda:
        device = type("Device", (), {"type": "cuda"})()
        dtype = torch.bfloat16
    monkeypatch.setattr(triton_ops, "self_check", lambda device, dtype: True)
    monkeypatch.setattr(layers, "_CUDA_OPS", {})
    assert layers.fused_ops_for(FakeCuda()) is triton_ops
    monkeypatch.setattr(triton_ops, "self_check", lambda device, dtype: False)
    monkeypatch.setattr(layers, "_CUDA_OPS", {})
    assert layers.fused_ops_for(FakeCuda()) is None  # a failed self-check: the torch ops
    monkeypatch.setattr(triton_ops, "self_check", lambda device, dtype: True)
    monkeypatch.setattr(layers, "_CUDA_OPS", {})
    monkeypatch.setenv(triton_ops.ENV, "0")
    assert layers.fused_ops_for(FakeCuda()) is None
    FakeCuda.dtype = torch.int64
    assert layers.fused_ops_for(FakeCuda()) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_self_check_passes_and_catches_a_broken_op(ops, dtype, monkeypatch):
    assert ops.self_check(torch.device(DEVICE), dtype)
    monkeypatch.setattr(ops, "silu_mul", lambda gate_up: gate_up[:, : gate_up.shape[1] // 2])
    assert not ops.self_check(torch.device(DEVICE), dtype)
