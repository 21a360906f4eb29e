"""The fused elementwise ops on CUDA, as Triton kernels: `add_rmsnorm`, `rmsnorm_rows`,
`silu_mul`, `rotary_inplace`, with the contracts of the C++ CPU ops (model/kernels) that
layers.py calls through `fused_ops_for`.

Why: a decode step of a small model on a GPU is a chain of tiny kernels. Measured on an H200
(SmolLM2-135M shape, bfloat16, single stream, a CUDA graph per step): 2.07 ms of device time
per step for ~1,000 kernels, most of them the unfused torch ops of RMSNorm (float conversion,
pow, mean, add, rsqrt, mul, conversion back, weight multiply: 8 launches per norm, 61 norms),
the residual adds, rotary (halves, products, cat, copy back) and silu * up. Each op here is one
launch per call.

Roundings: each kernel reproduces the unfused torch ops' roundings to the tensor's dtype
(statistics and products in float32, rounded where torch rounds), so a float32 model computes
the same function as the torch path up to the order of the mean's sum, and a bfloat16 one
rounds where the torch path rounds.

Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl

ENV = "TOKENWEIR_CUDA_FUSED_OPS"  # "0": the torch ops instead (for comparisons)
logger = logging.getLogger("tokenweir")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps,
                        rows_inner, stride_outer, stride_inner, stride_x, stride_out,
                        HAS_X: tl.constexpr, ROUND_NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the input lives at (r // rows_inner) * stride_outer + (r % rows_inner) *
    stride_inner (a [T, heads, dim] slice, or [T, dim] with rows_inner 1)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = (row // rows_inner).to(tl.int64) * stride_outer + (row % rows_inner) * stride_inner
    res = tl.load(res_ptr + base + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
        res = (res.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + base + cols, res, mask=mask)
    r = res.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / n_cols + eps)
    y = r * inv
    if ROUND_NORM:  # torch: weight * (x.float() * rsqrt(...)).to(dtype)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols,
             (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _norm(x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    dim = residual.shape[-1]
    assert residual.stride(-1) == 1 and weight.is_contiguous()
    if residual.dim() == 3:
        rows_inner, stride_outer, stride_inner = residual.shape[1], residual.stride(0), \
            residual.stride(1)
    else:
        rows_inner, stride_outer, stride_inner = 1, residual.stride(0), 0
    rows = residual.numel() // dim
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if rows == 0:
        return out
    if x is not None:
        assert x.is_contiguous() and x.shape == residual.shape and x.dtype == residual.dtype
    _add_rmsnorm_kernel[(rows,)](
        x if x is not None else residual, residual, weight, out, dim, eps,
        rows_inner, stride_outer, stride_inner, dim, dim,
        HAS_X=x is not None, ROUND_NORM=residual.dtype != torch.float32, BLOCK=_pow2(dim))
    return out


def add_rmsnorm(x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """residual += x in place (x given), then rmsnorm(residual) * weight, a new [T, dim]."""
    assert residual.dim() == 2 and residual.is_contiguous()
    return _norm(x, residual, weight, eps)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm over the last dim of x ([T, dim], or a [T, heads, dim] slice whose rows are
    contiguous), into a new contiguous tensor of x's shape. x is not written."""
    return _norm(None, x, weight, eps)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for a contiguous gate_up [T, 2I]."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, half,
                   stride_table, HALF_BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, HALF_BLOCK)
    mask = cols < half
    pos = tl.load(pos_ptr + t)
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_table + cols, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + cols, mask=mask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)  # torch: the tables cast to x's dtype first
    sin = sin.to(dtype).to(tl.float32)
    base = x_ptr + t * stride_t + head * stride_h
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + cols, mask=mask, other=0.0).to(tl.float32)
    # torch: x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded to dtype
    a1 = (x1 * cos).to(dtype).to(tl.float32)
    b1 = (x2 * sin).to(dtype).to(tl.float32)
    a2 = (x2 * cos).to(dtype).to(tl.float32)
    b2 = (x1 * sin).to(dtype).to(tl.float32)
    tl.store(base + cols, (a1 - b1).to(dtype), mask=mask)
    tl.store(base + half + cols, (a2 + b2).to(dtype), mask=mask)


def rotary_inplace(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
                   cos_cached: torch.Tensor, sin_cached: torch.Tensor) -> None:
    """Rotate x[:, :heads] ([T, heads_total, head_dim], rows of heads contiguous) in place at
    `positions` (int64 [T]) with the float32 tables [max_positions, head_dim // 2]
    (rotate-half layout)."""
    assert x.stride(2) == 1 and x.stride(1) == head_dim and head_dim % 2 == 0
    assert cos_cached.is_contiguous() and sin_cached.is_contiguous()
    if x.shape[0] == 0 or heads == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(x.shape[0], heads)](x, positions, cos_cached, sin_cached, x.stride(0),
                                        x.stride(1), half, cos_cached.stride(0),
                                        HALF_BLOCK=_pow2(half))


def self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """Run each op once on small random tensors of `dtype` on `device` against the torch ops;
    False (logged) when one fails to compile or run or disagrees beyond rounding, so that a
    Triton that cannot build these kernels costs speed, never a wrong answer or a crash."""
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 40, generator=gen).to(device, dtype)
        res = torch.randn(3, 40, generator=gen).to(device, dtype)
        w = torch.randn(40, generator=gen).to(device, dtype)
        want_res = res + x
        f = want_res.float()
        want = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
        got = add_rmsnorm(x, res, w, 1e-5)
        gate, up = x.chunk(2, dim=-1)
        qkv = torch.randn(3, 2, 8, generator=gen).to(device, dtype)
        rotated = qkv.clone()
        table = torch.rand(4, 4, generator=gen).to(device)
        rotary_inplace(rotated, 1, 8, torch.tensor([0, 3, 1], device=device), table, table)
        checks = [(res, want_res), (got, want),
                  (silu_mul(x.contiguous()), torch.nn.functional.silu(gate) * up),
                  (rotated[:, 1:], qkv[:, 1:])]
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        for a, b in checks:
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                raise AssertionError(f"max difference {(a.float() - b.float()).abs().max()}")
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch ops
        logger.warning("the fused Triton ops failed their self-check on %s %s (%s: %s): the "
                       "torch ops run instead", device, dtype, type(exc).__name__, exc)
        return False
