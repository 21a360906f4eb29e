"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SiLU-gated MLP.

All modules take flattened token-major tensors (`[T, ...]`); none of them holds per-request state.
Numerics follow transformers' Llama implementation (norm statistics in float32, RoPE cos/sin
computed in float32 then cast to the activation dtype) so float32 results agree to ~1e-6.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenweir.config import QUANTIZATIONS
from tokenweir.model import kernels


# CPU float32 matmuls of up to PACKED_MAX_ROWS rows of x (decode batches, small prefill
# chunks, the LM head's sampled rows) go to the packed-weight C++ kernel (linear_impl.h): the
# weight is packed once into panels (lazily, at its first such matmul) and the packed copy is
# kept beside the weight, which every other path still reads. Memory cost: one more float32
# copy of every Linear weight (and of the tied LM head) the kernel has served, e.g. +538 MB for
# SmolLM2-135M in float32. TOKENWEIR_PACK_LINEAR=0 opts out (no copy): then up to
# SKINNY_MAX_ROWS rows take the unpacked few-rows kernel, the rest MKL's sgemm.
# Measured on an AVX2 machine (2 threads, benchmarks/kernels.py --only linear and a whole-model
# sweep of the 30 layers' weights): the packed kernel beats the unpacked few-rows kernel from
# M = 4 (it ties at M = 1-2) and MKL's sgemm up to 512 rows: x0.68 of MKL's time at 64 rows,
# x0.77 at 128, x0.87 at 256, x0.98 at 512-1024, x1.14 at 2048 (MKL's blocked sgemm wins
# there). Chunked prefill at a 128-token budget ran 19% faster with 512 than with 64. The
# AVX-512 variant was not measured against MKL beyond 64 rows.
PACK_LINEAR = os.environ.get("TOKENWEIR_PACK_LINEAR", "1") != "0"
PACKED_MAX_ROWS = 512
PACKED_MAX_ROWS_LM_HEAD = 64
SKINNY_MAX_ROWS = 12
SKINNY_MAX_ROWS_LM_HEAD = 24


def _few_rows_f32(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """x @ weight.T is a CPU float32 2-D contiguous matmul of at most max_rows rows."""
    return (x.dim() == 2 and x.shape[0] <= max_rows and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_contiguous() and weight.is_contiguous())


def skinny_matmul_kernel(x: torch.Tensor, weight: torch.Tensor, max_rows: int):
    """The unpacked C++ kernel for `x @ weight.T` when it applies (CPU, float32, 2-D,
    contiguous, at most `max_rows` rows, kernels available), else None."""
    return kernels.skinny_linear_kernel() if _few_rows_f32(x, weight, max_rows) else None


_PACKED_ATTR = "_tokenweir_packed_weight"


_INT8_ATTR = "_tokenweir_int8_weight"  # the int8 copy has a slot of its own (kept beside)
_WIDENED_ATTR = "_tokenweir_widened_weight"  # float32 panels of a bfloat16 weight (invariant)
_AMX_ATTR = "_tokenweir_amx_weight"  # AMX tiles of a bfloat16 weight (invariant: amx_tiles_op)
DIRECT_ATTR = "_tokenweir_direct_stacks"  # model/direct.py's stacks, bound to packed copies


def packed_weight(owner: object, weight: torch.Tensor, kind: object,
                  pack: Callable[[torch.Tensor], Any], slot: str = _PACKED_ATTR) -> Any:
    """pack(weight), cached on `owner` (one packed weight per owner and slot) under `kind` (the
    layout). The cache is rebuilt when the weight's storage, shape or version, or the kind,
    changed; writes through `.data` bump no version, so whoever writes weights that way calls
    drop_packed_weights."""
    key = _packed_key(weight, kind)
    cached = getattr(owner, slot, None)
    if cached is None or cached[0] != key:
        cached = (key, pack(weight.detach()))
        object.__setattr__(owner, slot, cached)
    return cached[1]


def _packed_key(weight: torch.Tensor, kind: object) -> tuple:
    """What a packed copy was made from: the weight's storage, version, shape, and the kind."""
    version = None if weight.is_inference() else weight._version  # inference: untracked
    return (weight.data_ptr(), version, tuple(weight.shape), kind)


def install_packed_weight(owner: object, weight: torch.Tensor, kind: object,
                          packed: Any) -> None:
    """Hand `owner` a packed copy of `weight` made elsewhere (model/packed_cache.py reads them
    from the load cache), as if packed_weight had packed it now: the caller vouches that
    `packed` is pack(weight) for `kind`. A later write to the weight repacks as usual."""
    object.__setattr__(owner, _PACKED_ATTR, (_packed_key(weight, kind), packed))


def drop_packed_weights(module: nn.Module) -> None:
    """Forget every packed copy held by module and its submodules (after loading weights)."""
    for sub in (module, *module.modules()):
        sub.__dict__.pop(_PACKED_ATTR, None)
        sub.__dict__.pop(_INT8_ATTR, None)
        sub.__dict__.pop(_WIDENED_ATTR, None)
        sub.__dict__.pop(_AMX_ATTR, None)
        sub.__dict__.pop(DIRECT_ATTR, None)


# Weight-only int8 for decode matmuls (opt-in: `quantization="int8"`, --quantization int8).
# Per output channel, symmetric: w ~ q * s, q in [-127, 127], s = max |w_row| / 127, and torch's
# CPU int8 weight-only matmul (aten._weight_int8pack_mm) on the int8 copy, kept beside the
# weight (which every other row count still uses). Measured on SmolLM2's shapes (AVX-512 BF16,
# 2 threads, bfloat16): 1 row 0.44-0.68x the time of the oneDNN-packed bf16 matmul, 8 rows
# 1.25-1.9x (slower), 64 rows 2.3-3x: hence INT8_MAX_ROWS. Single-stream decode of SmolLM2 went
# 83 -> 114 tok/s. bfloat16 only: in float32 the same op took the decode from 55 to 20 tok/s
# (the float32 packed kernel reads weights at memory speed already). It needs K % 32 == 0 (K = 40
# gave wrong results and one crash in a probe); other shapes keep the unquantized path.
INT8_MAX_ROWS = 4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scales [N] in weight's dtype): w[n] ~ q[n] * scales[n]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


def _int8_applies(x: torch.Tensor, weight: torch.Tensor, owner: object) -> bool:
    return (getattr(owner, "quantization", None) == "int8" and x.dim() == 2
            and x.shape[0] <= INT8_MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.shape[1] % 32 == 0)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, owner: object) -> Optional[torch.Tensor]:
    """x @ weight.T on weight's int8 copy (made once, cached on owner) when owner opted in
    (`owner.quantization == "int8"`, see set_quantization), x is a CPU bfloat16 matrix of
    <= INT8_MAX_ROWS rows and K % 32 == 0; None otherwise (the caller's unquantized path)."""
    if not _int8_applies(x, weight, owner):
        return None
    q, scales = packed_weight(owner, weight, "int8", quantize_int8, slot=_INT8_ATTR)
    return torch._weight_int8pack_mm(x.contiguous(), q, scales)


def set_quantization(model: nn.Module, quantization: Optional[str]) -> None:
    """Every Linear of `model` and `model` itself (its LM head) take `quantization`'s path
    from now on (None: unquantized; an engine sets it on the model it runs)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, "
                         f"got {quantization!r}")
    for module in (model, *model.modules()):
        module.__dict__.pop(DIRECT_ATTR, None)  # its Linears were bound for the old path
        if module is model or isinstance(module, Linear):
            object.__setattr__(module, "quantization", quantization)


# Batch-invariant mode (issue 38; `--batch-invariant`, set_batch_invariant): a row's result
# must not depend on how many rows share the matmul. MKL's sgemm and oneDNN pick kernels and
# splits of K by the row count, and the packed kernel's own loop order changes with it (k unsplit
# up to 6 rows, k % KU accumulator sets at 1-3 rows). In this mode every Linear and the LM head
# take the packed kernel with `fixed_order` at every row count: one accumulator set, k cut at one
# fixed block size, so each row is summed in one order. bfloat16 rows are widened to float32 (an
# exact conversion) against float32 panels of the bfloat16 weight (+2x the weight's bytes) and
# the float32 sums rounded once to bfloat16, as a bfloat16 GEMM that accumulates in float32 does.
# float32 keeps the packed kernel even on AVX-512 (tried, issue 38): MKL's sgemm (F.linear) at
# one fixed row count does give a row the same bits in any tile (SmolLM2's shapes, tiles of
# 8/16/32, 1 and 2 threads), but tiles of it cost more than the packed fixed order at every row
# count measured (AMX Xeon, 2 threads, 30 layers + LM head: 1 row 14 ms packed vs 44 ms MKL in
# 16-row tiles / 39 ms oneDNN float32; 64 rows 69 vs 150 / 114, or 84 / 76 in 64-row tiles), and
# benchmarks/batch_invariance.py --dtypes float32 --repeats 2 (exclusive, 2 alternated pairs): W64
# 0.431x / 0.456x with 16-row tiles, 0.696x / 0.774x without; single stream 0.396 / 0.371 vs
# 0.948 / 0.957.
BATCH_INVARIANT_ATTR = "batch_invariant"


def batch_invariant(owner: object) -> bool:
    """Whether `owner` (a Linear, or the model for its LM head) runs batch-invariant matmuls."""
    return getattr(owner, BATCH_INVARIANT_ATTR, False)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, owner: object,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x [M, K] @ weight.T with every row's sums in one order whatever M (see above), in
    `out_dtype` (default: x's dtype). RuntimeError where the packed kernel cannot run it (off
    CPU, kernels unavailable, a dtype other than float32 / bfloat16): batch-invariant mode is
    refused before the model runs there (engine/llm_engine.py), never silently weakened.
    On CUDA: the Triton kernel of backends/triton_matmul.py (one tiling for every row count)."""
    if x.device.type == "cuda" and x.dim() == 2:
        from tokenweir.model.backends.triton_matmul import invariant_matmul as on_cuda
        return on_cuda(x, weight, out_dtype or x.dtype)
    if x.device.type != "cpu" or x.dim() != 2:
        raise RuntimeError(f"batch-invariant matmuls take a CPU or CUDA 2-D input (got "
                           f"{tuple(x.shape)} on {x.device.type})")
    return invariant_matmul_op(weight, owner, out_dtype or x.dtype)(x)


def invariant_matmul_op(weight: torch.Tensor, owner: object,
                        out_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """invariant_matmul on `weight` as it is now, resolved once (kernel, panels): a function of
    a CPU 2-D x (Linear.bind's use)."""
    kernel = kernels.packed_linear_kernel()
    if kernel is not None and native_bf16_tiles(weight):
        return tiled_onednn_op(weight, owner, out_dtype)
    if kernel is None or weight.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"batch-invariant matmuls need the C++ CPU kernels and a float32 or "
                           f"bfloat16 weight (got {weight.dtype}, kernels "
                           f"{'on' if kernel else 'off'})")
    # float32 shares the default packed panels; bfloat16's widened ones have a slot of their
    # own, so an owner switched in and out of the mode keeps both (no repacking per switch)
    slot = _PACKED_ATTR if weight.dtype == torch.float32 else _WIDENED_ATTR
    panels = packed_weight(owner, weight, kernel.panel,
                           lambda w: kernels.pack_linear_weight(w.float(), kernel.panel), slot)
    n = weight.shape[0]
    if out_dtype == torch.float32:
        return lambda x: kernel(x.float().contiguous(), panels, n, fixed_order=True)
    return lambda x: kernel(x.float().contiguous(), panels, n, fixed_order=True).to(out_dtype)


# On a CPU with native bfloat16 (the kernels' "avx512bf16" variant: AVX-512 BF16, and AMX where
# oneDNN finds it) a bfloat16 weight's invariant matmul is oneDNN's own bfloat16 GEMM on the
# oneDNN-packed weight (the flag-off path's copy: no widened panels), every row given the bits
# an INVARIANT_TILE_ROWS-row call gives it: x is cut into tiles of that many rows (the last
# padded with zeros), or of a larger size only where a probe found it agrees (INVARIANT_BIG_TILES).
# oneDNN picks its kernel and blocking by the shape, and with one shape every row's sums ran in
# one order: measured (torch 2.13.0's oneDNN, 1 and 2 threads, SmolLM2's five weight shapes and
# four odd ones, tiles of 1-128 rows, the row at 6 positions among random or zero rows) a row's
# result was the same bits wherever it sat in a tile of a given size and whatever the other
# rows; across tile sizes it was not (N = 3072 and 49152: tiles under 64 rows differ from 64).
# tests/model/test_batch_invariant_ops.py checks it on every run, so a torch or oneDNN version
# that changes it fails there. TOKENWEIR_CPU_ISA=avx512 / avx2 keep the widened float32 path.
# The size: one oneDNN call on SmolLM2's weights (this AMX CPU, 2 threads, exclusive, min of
# runs) costs per decode step (30 layers + LM head) 6.6 ms at 1 row, 7.8 ms at 16, 14.7 ms at
# 32, 20.4 ms at 64: 16 keeps a single-stream step within ~1.2 ms of one row, at ~1.5x the
# matmul time of 64-row tiles for a 64-row step (4 calls of 16: 31 ms vs 20.4 ms).
INVARIANT_TILE_ROWS = 16


def native_bf16_tiles(weight: torch.Tensor) -> bool:
    """Whether invariant matmuls on `weight` take tiled_onednn_op (see INVARIANT_TILE_ROWS)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous()
            and kernels.cpu_isa() == "avx512bf16" and onednn_bf16_packing())


def tiled_onednn_op(weight: torch.Tensor, owner: object,
                    out_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [M, K] -> x @ weight.T (bfloat16 GEMM, float32 accumulation, rounded to bfloat16, then
    `out_dtype`), every row computed with the bits an INVARIANT_TILE_ROWS-row oneDNN call gives
    it: by the AMX kernel where it applies (amx_tiles_op), else by calls of the sizes
    invariant_tile_plan picks (see INVARIANT_BIG_TILES), x padded with zero rows to their sum."""
    packed = packed_weight(owner, weight, "onednn", onednn_pack)
    amx = amx_tiles_op(weight, owner, packed, out_dtype)
    if amx is not None:
        return amx
    n, k = weight.shape

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty((0, n), dtype=out_dtype)
        plan = invariant_tile_plan(rows, lambda size: onednn_tile_agrees(packed, n, k, size))
        outs = _onednn_calls(x, plan, packed)
        out = (outs[0] if len(outs) == 1 else torch.cat(outs))[:rows]
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    return run


def _onednn_calls(x: torch.Tensor, sizes: list[int], packed: torch.Tensor) -> list[torch.Tensor]:
    """oneDNN on consecutive slices of x of `sizes` rows each, in order (x padded with zero rows
    where the sizes sum to more than its rows): one output per call."""
    covered, rows = sum(sizes), x.shape[0]
    if covered > rows:
        x = torch.cat((x, x.new_zeros((covered - rows, x.shape[1]))))
    outs, start = [], 0
    for size in sizes:
        outs.append(onednn_linear(x[start:start + size], packed, None))
        start += size
    return outs


# The AMX kernel (kernels.amx_linear_kernel, amx_linear_impl.h; bi14): on a CPU with AMX-BF16
# one call on all the rows, each row summed in one order (k blocks of 32 in turn, in an AMX
# tile) whatever the rows: the bits oneDNN's 16-row calls give (its own 16-row kernel is the
# same AMX sums: equal on SmolLM2's five shapes and random data, and
# tests/model/test_batch_invariant_ops.py checks it on every run). It replaces the 16- and
# 32-row oneDNN calls, each of which read the whole weight: a 64-row decode step made two
# 32-row calls per weight. Steps of over 768 rows still make the probed 1024/2048-row oneDNN
# calls (faster there than this kernel), each size only where the probe finds it gives this
# kernel's bits; the rest of the rows go to one AMX call. Memory: one more bfloat16 copy of
# every weight it serves (the AMX tile layout), beside the oneDNN-packed one.
# TOKENWEIR_AMX_LINEAR=0 keeps the oneDNN tiles (to compare).
AMX_BIG_TILES = (2048, 1024)  # INVARIANT_BIG_TILES' big sizes: under 769 rows, one AMX call


def amx_tiles_op(weight: torch.Tensor, owner: object, packed: torch.Tensor,
                 out_dtype: torch.dtype) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """x -> x @ weight.T rounded to bfloat16, in `out_dtype`, by the AMX kernel (plus oneDNN's
    probed big calls on `packed`, the oneDNN-packed weight, for steps of over 768 rows), or
    None where the kernel does not run or the shape does not fit it (N or K not a multiple of
    32)."""
    kernel = kernels.amx_linear_kernel()
    n, k = weight.shape
    if kernel is None or n % 32 or k % 32 or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    tiles = packed_weight(owner, weight, "amx", kernels.pack_amx_weight, slot=_AMX_ATTR)
    widen = out_dtype == torch.float32  # the kernel widens the rounded values itself

    def amx(x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        return kernel(x, tiles, n, float_out)

    def agrees(size: int) -> bool:  # the big sizes only: the rest is one AMX call
        return size in AMX_BIG_TILES and onednn_tile_agrees(packed, n, k, size, amx)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        rows = x.shape[0]
        if rows <= min(AMX_BIG_TILES) * 3 // 4:  # no big call can apply
            return amx(x, widen)
        big = [size for size in invariant_tile_plan(rows, agrees) if size in AMX_BIG_TILES]
        outs = _onednn_calls(x, big, packed)
        covered = sum(big)
        if covered < rows:
            outs.append(amx(x[covered:]))
        out = (outs[0] if len(outs) == 1 else torch.cat(outs))[:rows]
        return out.to(out_dtype) if widen else out
    return run


# Larger oneDNN calls where they give every row the INVARIANT_TILE_ROWS-row bits (bi13): with 16
# rows a call, a 1000-row prefill step made 63 calls per weight, each reading the whole weight
# (and a Python round trip). oneDNN's blocking changes with the row count, so which sizes agree
# with 16-row calls is shape- and thread-dependent and not documented: probed on this CPU
# (torch 2.13.0, SmolLM2's five shapes and two odd ones, 1 and 2 threads, every row of 3 random
# draws compared) 32 agreed everywhere, 1024 and 2048 on most shapes, and 48-512 on few (64:
# on none of SmolLM2's). So each size is probed at run time, on first need, per (N, K, size,
# threads): onednn_tile_agrees. A size that does not agree is never called.
INVARIANT_BIG_TILES = (2048, 1024, 32)
_TILE_AGREES: dict[tuple[int, int, int, int], bool] = {}


def invariant_tile_plan(rows: int, agrees: Callable[[int], bool]) -> list[int]:
    """The call sizes, in order, that cover `rows` rows (their sum may exceed rows: zero rows
    pad the last call): each size of INVARIANT_BIG_TILES that `agrees` while the rows left fill
    over 3/4 of it (a big size) or all of it (the smallest), then INVARIANT_TILE_ROWS-row calls.
    `agrees(size)` is asked only of sizes the plan could use."""
    plan, left = [], rows
    smallest = min(INVARIANT_BIG_TILES)
    for size in INVARIANT_BIG_TILES:
        need = size if size == smallest else size * 3 // 4 + 1
        while left >= need and agrees(size):
            plan.append(size)
            left -= size
    while left > 0:
        plan.append(INVARIANT_TILE_ROWS)
        left -= INVARIANT_TILE_ROWS
    return plan


def onednn_tile_agrees(packed: torch.Tensor, n: int, k: int, size: int,
                       reference: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> bool:
    """Whether oneDNN on `size` rows gives each row the bits INVARIANT_TILE_ROWS-row calls give
    it (or, with `reference`, the bits reference(rows) gives: the AMX kernel's), for [n, k]
    weights at this thread count: probed once on `packed` (three draws of random rows, one of
    them mostly zero rows as a padded call has), then remembered."""
    key = (n, k, size, torch.get_num_threads()) + (() if reference is None else ("amx",))
    if key not in _TILE_AGREES:
        _TILE_AGREES[key] = _probe_tile(packed, k, size, reference or (
            lambda x: _onednn_tiles(x, packed)))
    return _TILE_AGREES[key]


def _onednn_tiles(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    tile = INVARIANT_TILE_ROWS
    return torch.cat([onednn_linear(x[s:s + tile], packed, None)
                      for s in range(0, x.shape[0], tile)])


def _probe_tile(packed: torch.Tensor, k: int, size: int,
                reference: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    gen = torch.Generator().manual_seed(size)
    for draw in range(3):
        x = torch.randn(size, k, generator=gen).to(torch.bfloat16)
        if draw == 2:
            x[size // 3:] = 0
        if not torch.equal(onednn_linear(x, packed, None), reference(x)):
            return False
    return True


def set_batch_invariant(model: nn.Module, enabled: bool) -> None:
    """Every Linear of `model` and `model` itself (its LM head) take invariant_matmul from now
    on (or stop, `enabled` False); the runner reads `model.batch_invariant` to ask the same of
    attention (model/attention.py). Bound direct-path stacks are dropped (rebound on use)."""
    for module in (model, *model.modules()):
        module.__dict__.pop(DIRECT_ATTR, None)
        if module is model or isinstance(module, Linear):
            object.__setattr__(module, BATCH_INVARIANT_ATTR, bool(enabled))


def few_rows_matmul(x: torch.Tensor, weight: torch.Tensor, owner: object, packed_max_rows: int,
                    skinny_max_rows: int) -> Optional[torch.Tensor]:
    """x @ weight.T by a C++ kernel when one applies: the packed kernel up to packed_max_rows
    rows (weight packed once, cached on owner; unless TOKENWEIR_PACK_LINEAR=0), else the
    unpacked one up to skinny_max_rows; None when neither applies (the caller's torch path)."""
    if PACK_LINEAR and _few_rows_f32(x, weight, packed_max_rows):
        kernel = kernels.packed_linear_kernel()
        if kernel is not None:
            panels = packed_weight(owner, weight, kernel.panel,
                                   lambda w: kernels.pack_linear_weight(w, kernel.panel))
            return kernel(x, panels, weight.shape[0])
    skinny = skinny_matmul_kernel(x, weight, skinny_max_rows)
    return None if skinny is None else skinny(x, weight)


# Bounded memory (issue 14, item 8). A CPU bfloat16 matmul goes to oneDNN, which JIT-builds and
# caches a primitive per distinct shape (ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, default 1024),
# each holding native memory (measured ~0.7 MB with oneDNN's f32 linear on this AVX2 machine:
# 768 distinct shapes took RSS from 246 to 777 MB). The rows M of a step's matmuls (its tokens)
# take every value up to the token budget, so RSS grew by hundreds of MB until the cache filled.
# Padding M up to a bucket bounds the distinct shapes: exact up to 16 rows (decode batches),
# then 8 buckets per power of two (at most 12.5% padded rows); 88 shapes per weight up to 8192
# rows. float32 needs none (MKL's sgemm and the C++ kernels keep no per-shape state).
# TOKENWEIR_MATMUL_ROW_BUCKETS=0 turns it off (to measure the difference).
BUCKET_ROWS = os.environ.get("TOKENWEIR_MATMUL_ROW_BUCKETS", "1") != "0"
EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The number of rows `rows` is padded to: itself up to EXACT_ROWS, else the next multiple
    of 2**(k-3) for rows in [2**k, 2**(k+1))."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


# CPU bfloat16 matmuls go to oneDNN with the weight reordered ONCE into oneDNN's blocked layout
# (torch.ops.mkldnn._reorder_linear_weight, kept beside the weight like the float32 panels; its
# results matched F.linear's bits in every case checked, the tests allow bfloat16 rounding).
# F.linear hands oneDNN the plain weight and it reorders it on every call. Measured on an
# AVX-512 BF16 machine (Zen 5, 2 threads, SmolLM2's five weight shapes): x1.6-2.0 the speed at
# 1-4 rows, x1.2-1.5 at 16-64, x1.03-1.1 at 512-2048;
# the batch-size hint given to the reorder made no difference across 1-2048 rows. CPUs where
# oneDNN refuses to pack bfloat16 (AVX2 only) keep F.linear. TOKENWEIR_PACK_LINEAR=0 opts out.
ONEDNN_PACK_HINT_ROWS = 64
_ONEDNN_PACKING: dict[str, bool] = {}


def onednn_bf16_packing() -> bool:
    """Whether oneDNN packs bfloat16 linear weights on this CPU (probed once)."""
    if "ok" not in _ONEDNN_PACKING:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
            _ONEDNN_PACKING["ok"] = True
        except (RuntimeError, AttributeError):
            _ONEDNN_PACKING["ok"] = False
    return _ONEDNN_PACKING["ok"]


def _onednn_packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (PACK_LINEAR and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.dim() == 2 and weight.is_contiguous()
            and onednn_bf16_packing())


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 -> oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_HINT_ROWS)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ w.T + bias on a weight packed by onednn_pack."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            owner: Optional[object]) -> torch.Tensor:
    """F.linear(x, weight, bias), on the oneDNN-packed weight cached on `owner` where it
    applies (see ONEDNN_PACK_HINT_ROWS)."""
    if owner is None or not _onednn_packs(x, weight):
        return F.linear(x, weight, bias)
    return onednn_linear(x, packed_weight(owner, weight, "onednn", onednn_pack), bias)


# Bfloat16 matmuls of up to AMX_MAX_ROWS rows (decode steps, small chunks, the LM head's
# sampled rows), without a bias, on the AMX kernel (amx_linear_impl.h, written for the
# batch-invariant mode) where it runs, instead of oneDNN; unpadded (it keeps no per-shape state).
# Measured (this Xeon with AMX, 2 threads, exclusive): on one weight hot in cache, SmolLM2's
# shapes, 1 row, a layer's four matmuls 324 us on oneDNN, 170 us on AMX, the LM head 2.05 vs
# 1.77 ms; one pass over all 121 weights (30 layers' four and the LM head, so from memory), min
# of 5, two rounds: 1 row 16.4 / 27.7 ms vs 11.3 / 16.9, 32 rows 19.2 / 41.4 vs 13.6 / 24.8, 64
# rows 20.7 / 27.5 vs 18.5 / 23.8, 96 rows 44.5 / 35.7 vs 50.9 / 51.6 (oneDNN wins from 96 on).
# Single-stream decode of SmolLM2 ran its 121 matmuls a token in 14.1 ms (~19 GB/s of weights),
# the whole decode 1.49x, 32 streams 1.41x (README); at 64 streams two pairs of offline runs
# disagreed (781 / 868 vs 1110 / 775 tok/s), so the limit stays at 32 until measured better. Bits: every row is summed in one order whatever the rows; at
# 1-16 rows that is oneDNN's own (tests/model/test_amx_decode.py checks it where it runs),
# above that oneDNN's differ by bfloat16 rounding. A weight with a bias keeps oneDNN, which adds
# it before rounding once (the kernel rounds its sums). Memory: one more bfloat16 copy of every
# weight it reads (the AMX tile layout), beside the oneDNN-packed one: +270 MB for SmolLM2-135M.
# TOKENWEIR_AMX_LINEAR=0 keeps oneDNN (and makes no copy).
AMX_MAX_ROWS = 32


def amx_linear_op(weight: torch.Tensor, bias: Optional[torch.Tensor],
                  owner: object) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """x [M, K] bfloat16 -> x @ weight.T by the AMX kernel on tiles cached on `owner`, or None
    where it does not apply: no AMX (or TOKENWEIR_AMX_LINEAR=0), a bias, N or K not a multiple
    of 32. Correct for any M; used for M in 1..AMX_MAX_ROWS (see above)."""
    if bias is not None:
        return None
    kernel = kernels.amx_linear_kernel()
    if kernel is None or not native_bf16_tiles(weight):
        return None
    n, k = weight.shape
    if n % 32 or k % 32:
        return None
    tiles = packed_weight(owner, weight, "amx", kernels.pack_amx_weight, slot=_AMX_ATTR)
    return lambda x: kernel(x.contiguous(), tiles, n, False)


def _amx_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              owner: Optional[object]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """amx_linear_op for this x where x's rows are AMX's (1..AMX_MAX_ROWS), else None."""
    if owner is None or not _onednn_packs(x, weight) or not 0 < x.shape[0] <= AMX_MAX_ROWS:
        return None
    return amx_linear_op(weight, bias, owner)


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    owner: Optional[object] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with a 2-D CPU bfloat16/float16 x padded to row_bucket rows
    (the pad rows are zeros; the result has x's rows). With an `owner`, bfloat16 runs on the
    AMX kernel up to AMX_MAX_ROWS rows where it applies (unpadded), else on the weight packed
    for oneDNN once and cached on it (see ONEDNN_PACK_HINT_ROWS)."""
    amx = _amx_rows(x, weight, bias, owner)
    if amx is not None:
        return amx(x)
    if (not BUCKET_ROWS or x.dim() != 2 or x.device.type != "cpu"
            or x.dtype not in (torch.bfloat16, torch.float16)):
        return _linear(x, weight, bias, owner)
    return on_bucketed_rows(lambda padded: _linear(padded, weight, bias, owner), x)


def on_bucketed_rows(matmul: Callable[[torch.Tensor], torch.Tensor],
                     x: torch.Tensor) -> torch.Tensor:
    """matmul(x) with x [rows, K] padded by zero rows to row_bucket(rows); x's rows of it."""
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded == rows:
        return matmul(x)
    x_padded = x.new_zeros((padded, x.shape[1]))
    x_padded[:rows] = x
    return matmul(x_padded)[:rows]


class Linear(nn.Linear):
    """nn.Linear without random init: parameters start uninitialized (weights are loaded).
    A few rows on CPU float32 take a C++ kernel (see PACK_LINEAR); CPU bfloat16 rows are padded
    to a bucket (see BUCKET_ROWS) and run on a oneDNN-packed weight (ONEDNN_PACK_HINT_ROWS)."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant(self):
            return _with_bias(lambda y: invariant_matmul(y, self.weight, self), self.bias)(x)
        out = int8_matmul(x, self.weight, self)
        if out is None:
            out = few_rows_matmul(x, self.weight, self, PACKED_MAX_ROWS, SKINNY_MAX_ROWS)
        if out is None:
            return bucketed_linear(x, self.weight, self.bias, owner=self)
        return out if self.bias is None else out.add_(self.bias)

    def bind(self, x: torch.Tensor) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The op `forward` runs on x, resolved now (weights packed now, once): a function of
        one argument that computes forward(y) for every contiguous y of x's dtype, device and
        row class, with this weight as it is now. Row classes: each count up to EXACT_ROWS
        alone, and every count above it (within a class, forward's route does not change, or
        the function picks it by rows as forward does). None off CPU or for a non-2-D x. For
        callers that run many steps and check the weight's version themselves
        (model/direct.py): forward's per-call routing is what it saves."""
        weight, bias = self.weight, self.bias
        probe = x.contiguous()
        if probe.device.type != "cpu" or probe.dim() != 2:
            return None
        if batch_invariant(self):
            return _with_bias(invariant_matmul_op(weight, self, probe.dtype), bias)
        small = probe.shape[0] <= EXACT_ROWS
        if small and _int8_applies(probe, weight, self):
            q, scales = packed_weight(self, weight, "int8", quantize_int8, slot=_INT8_ATTR)
            return _with_bias(lambda y: torch._weight_int8pack_mm(y, q, scales), bias)
        if probe.dtype == torch.float32 and weight.dtype == torch.float32:
            return self._bind_float32(probe, small)
        if _onednn_packs(probe, weight):
            amx = amx_linear_op(weight, bias, self)
            if amx is not None and small:
                return amx
            packed = packed_weight(self, weight, "onednn", onednn_pack)
            if small or not BUCKET_ROWS:
                onednn = lambda y: onednn_linear(y, packed, bias)  # noqa: E731
            else:
                onednn = lambda y: on_bucketed_rows(  # noqa: E731
                    lambda z: onednn_linear(z, packed, bias), y)
            if amx is None:
                return onednn
            return lambda y: amx(y) if y.shape[0] <= AMX_MAX_ROWS else onednn(y)
        return self.forward

    def _bind_float32(self, x: torch.Tensor, small: bool) -> Callable[[torch.Tensor],
                                                                       torch.Tensor]:
        """bind for float32: the packed kernel (up to PACKED_MAX_ROWS rows, then F.linear as
        forward), the unpacked few-rows kernel (TOKENWEIR_PACK_LINEAR=0, up to SKINNY_MAX_ROWS)
        or F.linear."""
        weight, bias = self.weight, self.bias
        kernel = kernels.packed_linear_kernel() if PACK_LINEAR else None
        if kernel is not None and _few_rows_f32(x[:1], weight, 1):  # any rows: see below
            panels = packed_weight(self, weight, kernel.panel,
                                   lambda w: kernels.pack_linear_weight(w, kernel.panel))
            packed = _with_bias(lambda y: kernel(y, panels, weight.shape[0]), bias)
            if small:
                return packed
            return lambda y: packed(y) if y.shape[0] <= PACKED_MAX_ROWS else F.linear(y, weight,
                                                                                      bias)
        skinny = skinny_matmul_kernel(x, weight, SKINNY_MAX_ROWS) if small else None
        if skinny is not None:
            return _with_bias(lambda y: skinny(y, weight), bias)
        return self.forward


def _with_bias(matmul: Callable[[torch.Tensor], torch.Tensor],
               bias: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """matmul, followed by adding bias in place when there is one (as Linear.forward does)."""
    if bias is None:
        return matmul
    return lambda y: matmul(y).add_(bias)


class Embedding(nn.Embedding):
    """nn.Embedding without random init: the table starts uninitialized (weights are loaded)."""

    def reset_parameters(self) -> None:
        pass


def fused_ops_for(x: torch.Tensor):
    """The module with `add_rmsnorm`, `silu_mul` and `rotary_inplace` when they apply to x, else
    None (callers keep a torch path): on CPU the compiled C++ ops (float32 or bfloat16, kernels
    available), on CUDA the Triton ones (model/backends/triton_ops.py: float32, bfloat16,
    float16, triton installed). Both reproduce the unfused torch ops' roundings."""
    if x.device.type == "cuda":
        return _cuda_fused_ops(x) if x.dtype in (torch.float32, torch.bfloat16,
                                                 torch.float16) else None
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels.fused_ops()


_CUDA_OPS: dict = {}


def _cuda_fused_ops(x: torch.Tensor):
    """tokenweir.model.backends.triton_ops, or None (no triton, TOKENWEIR_CUDA_FUSED_OPS=0, or
    its self-check failed on this device and dtype: logged, and the torch ops run instead);
    decided once per process and dtype."""
    if x.dtype not in _CUDA_OPS:
        from tokenweir.model.backends import triton_available
        ops = None
        if triton_available():
            from tokenweir.model.backends import triton_ops
            if triton_ops.enabled() and triton_ops.self_check(x.device, x.dtype):
                ops = triton_ops
        _CUDA_OPS[x.dtype] = ops
    return _CUDA_OPS[x.dtype]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I]."""
    ops = fused_ops_for(gate_up) if gate_up.dim() == 2 and gate_up.is_contiguous() else None
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32, output in x's dtype."""

    def __init__(self, dim: int, eps: float, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and x.stride(-1) == 1 and x.dim() in (2, 3):
            ops = fused_ops_for(x)
            if ops is not None and self.weight.dtype == x.dtype:
                return ops.rmsnorm_rows(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place, when x is given), then return norm(residual): the residual
        add and the norm of a pre-norm block in one pass where the fused op applies.
        residual must be a [T, dim] tensor the caller owns."""
        ops = fused_ops_for(residual)
        if (ops is not None and residual.dim() == 2 and residual.is_contiguous()
                and (x is None or (x.is_contiguous() and x.dtype == residual.dtype))
                and self.weight.dtype == residual.dtype):
            return ops.add_rmsnorm(x, residual, self.weight, self.eps)
        if x is not None:
            residual.add_(x)
        return self(residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for plain, "linear" or "llama3" RoPE.

    "freq_factors" scaling (GGUF `rope_freqs.weight`) starts from the plain frequencies; the
    factors are applied later by `RotaryEmbedding.set_freq_factors`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency remapping: long wavelengths divided by `factor`, short ones kept,
    a smooth interpolation in between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table [max_positions, head_dim // 2] (float32), rotate-half layout
    (the Hugging Face convention: pairs are (i, i + head_dim/2))."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta, self.scaling = theta, scaling
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build()

    def rebuild(self) -> None:
        """Recompute the tables on the buffers' current device (after `to_empty`)."""
        device = self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        self._build()

    def _build(self) -> None:
        pos = torch.arange(self.max_positions, dtype=torch.int64, device=self.inv_freq.device)
        freqs = pos.float()[:, None] * self.inv_freq.float()[None, :]
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency factors (GGUF `rope_freqs.weight`) and
        rebuild the table."""
        self.inv_freq = (self.inv_freq.float() / factors.float().to(self.inv_freq.device))
        self._build()

    def _apply(self, fn, recurse=True):  # keep the tables in float32 across .to(dtype)
        result = super()._apply(fn, recurse)
        for name in ("inv_freq", "cos_cached", "sin_cached"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return result

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim // 2] in `dtype`, for the given absolute positions."""
        cos = self.cos_cached.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cached.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryStep":
        return RotaryStep(self, positions, dtype)


class RotaryStep:
    """The rotation of one step's positions, shared by every layer: the fused in-place kernel
    where it applies (it reads the float32 tables at the positions), else cos/sin gathered once
    (lazily) and the torch ops."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.rope, self.positions, self.dtype = rope, positions, dtype
        self._cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self.rope(self.positions, self.dtype)
        return self._cos_sin

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated copy."""
        return apply_rotary(x, *self.cos_sin())

    def rotate_leading_heads_(self, x: torch.Tensor, heads: int) -> None:
        """Rotate x[:, :heads] in place; x is [T, heads_total, head_dim] with contiguous rows
        (the fused qkv output: q and k heads first)."""
        ops = fused_ops_for(x)
        if (ops is not None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and self.positions.dtype == torch.long and self.positions.is_contiguous()):
            ops.rotary_inplace(x, heads, x.shape[2], self.positions, self.rope.cos_cached,
                               self.rope.sin_cached)
            return
        x[:, :heads] = self.rotate(x[:, :heads])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by (cos, sin) [T, 1, head_dim // 2]; returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (`gate_up_proj`,
    rows [0, I) = gate, [I, 2I) = up)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.intermediate = intermediate
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_up_proj = Linear(hidden, 2 * intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))
