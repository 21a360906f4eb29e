"""The batch-invariant matmul on CUDA (issue 38): x [M, K] @ w[N, K]^T as one Triton kernel
whose tiling and order of K are the same for every M, so a row's result does not depend on how
many rows share the call, nor on where in the call the row sits.

Why not cuBLAS: it picks a kernel (tile shape, split-K, stream-K) by the problem's shape, M
included, so a row's sums change order with the batch (the cause Thinking Machines' "Defeating
Nondeterminism in LLM Inference" names; vLLM's and SGLang's batch-invariant modes replace the
matmul for it). Here every call launches the same compiled kernel: one tile size
(BLOCK_M x BLOCK_N x BLOCK_K) whatever M, no split of K across programs, K walked in order from
0 with one float32 accumulator per output element (tl.dot accumulating into it). A tile's dot
computes each output element by the same instructions whatever the other rows of the tile
hold (zeros past M), so row m's bits depend only on row m, w and K. M is not specialised on
(do_not_specialize), so no row count compiles a variant of its own.

float32: IEEE dots (no TF32). bfloat16 / float16: dots in that dtype, float32 accumulation,
one rounding at the store. Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (the tests; the
interpreter computes dots in numpy, in float32 for every dtype, as sums of products:
_triton_kernel.py, sum_dot).
"""

from __future__ import annotations

import os

import torch

# One tiling for every call (see above). 64 x 64 x 32: four warps, no split of K.
BLOCKS = (64, 64, 32)

_JITTED: dict[bool, object] = {}


def kernel():
    """The jitted kernel for the current TRITON_INTERPRET mode (once per mode)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpret not in _JITTED:
        from tokenweir.model.backends._triton_kernel import invariant_matmul_kernel, jit_for_mode
        _JITTED[interpret] = jit_for_mode(invariant_matmul_kernel, do_not_specialize=["M"])
    return _JITTED[interpret]


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor,
                     out_dtype: torch.dtype | None = None,
                     blocks: tuple[int, int, int] = BLOCKS) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T in `out_dtype` (default x's), every row in one fixed order
    (see the module docstring). x and weight: one dtype, last dim contiguous, on CUDA (or on
    CPU under TRITON_INTERPRET=1). `blocks` is for tests (tiny tiles in the interpreter)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} do not multiply")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.to(x.dtype)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k = blocks
    grid = (-(-m // block_m), -(-n // block_n))
    kernel()[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0),
                   out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                   F32_DOT=x.dtype == torch.float32 or x.device.type != "cuda",
                   SUM_DOT=x.device.type != "cuda")
    return out
