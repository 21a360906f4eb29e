"""Paged variable-length attention as ONE Triton kernel launch per layer per step.

Decodes and prefill chunks run in the same launch. The grid is (tiles, KV heads): a tile is up
to BLOCK_Q consecutive query tokens of one request, and its program attends them for the G query
heads that share one KV head (GQA folded into the rows: row r is token r // G, head r % G, so
BLOCK_M = BLOCK_Q * G rows rounded up to a power of two). The program walks the request's
context BLOCK_N keys at a time, looking each key's block up in the block table (K/V are read in
place from the paged cache: no gather, no copy), with an online softmax in float32, and masks
keys past the row's own position (causal, offset by the cached prefix) or past the context.

Per-step plan (built once at the first layer, kept on the metadata): the tile table
`tile_seq[i]`, `tile_start[i]` (request index, first query token of tile i within it). For a
decode-only step it is arange(B), zeros(B): one tile per request, which is what a CUDA-graph
bucket captures with static buffers (padded requests have zero query tokens: their rows are
masked and nothing is stored).

Precision: float32 inputs use IEEE dots (no TF32), so float32 results match the reference to
~1e-5; bfloat16/float16 dot in their dtype and accumulate in float32. Under the interpreter
every dot runs in float32 (F32_DOT): triton 3.9's interpreter returns garbage for bfloat16
`tl.dot` (numpy has no bfloat16), so CPU tests check bfloat16 loads, stores and masking, and
the CUDA tests the bfloat16 dots.

Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (set before the first use: the kernel is
jitted lazily, on first use, in the mode the environment names then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from tokenweir.model.attention import write_kv

BLOCK_N = 32  # keys per inner iteration (any block size: each key's block is looked up)
PREFILL_BLOCK_M = 64  # rows per tile when the step has prefill chunks (tl.dot needs >= 16)


_JITTED: dict[bool, object] = {}


def kernel():
    """The jitted kernel for the current TRITON_INTERPRET mode (jitted once per mode)."""
    from tokenweir.model.backends._triton_kernel import jit_for_mode, paged_attention_kernel
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpret not in _JITTED:
        # the block-table width changes from step to step (and is 1 for short contexts):
        # specialising on it (== 1, % 16) would compile new variants mid-serving
        _JITTED[interpret] = jit_for_mode(paged_attention_kernel,
                                          do_not_specialize=["stride_bt", "scale"])
    return _JITTED[interpret]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class TritonPlan:
    """The step's tile table and launch sizes (see the module docstring)."""

    tile_seq: torch.Tensor  # int32 [tiles]
    tile_start: torch.Tensor  # int32 [tiles]
    block_m: int
    block_q: int
    sum_dot: bool = False  # batch-invariant mode off CUDA: the interpreter's exact-order dots


def tile_table(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(request index, first query token) of every tile of at most block_q query tokens."""
    seqs: list[int] = []
    starts: list[int] = []
    for i, q_len in enumerate(query_lens):
        for start in range(0, q_len, block_q):
            seqs.append(i)
            starts.append(start)
    return seqs, starts


def launch_sizes(group: int, decode_only: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a decode tile holds one token's G heads; a prefill tile as many
    tokens as fit PREFILL_BLOCK_M rows (at least one)."""
    if decode_only:
        return max(16, _next_pow2(group)), 1
    block_m = max(PREFILL_BLOCK_M, _next_pow2(group))
    return block_m, block_m // group


def plan_step(meta, group: int, device: torch.device) -> TritonPlan:
    """Batch-invariant mode (`meta.batch_invariant`): every step takes the prefill launch
    sizes, decode-only steps too, so every row runs in a tile of one shape (one compiled
    kernel): its dots are the same instructions, its keys walked in the same BLOCK_N chunks
    from key 0, and the chunks past its own position (a longer row of its tile) add exact
    zeros (p = 0, alpha = 1). A row's result is then its decode's whatever its tile."""
    decode_only = (meta.num_decodes == len(meta.query_lens_cpu)
                   and not getattr(meta, "batch_invariant", False))
    block_m, block_q = launch_sizes(group, decode_only)
    seqs, starts = tile_table(meta.query_lens_cpu, block_q)
    both = torch.tensor([seqs, starts], dtype=torch.int32)
    if device.type == "cuda":
        both = both.pin_memory().to(device, non_blocking=True)
    else:
        both = both.to(device)
    invariant = getattr(meta, "batch_invariant", False)
    return TritonPlan(both[0], both[1], block_m, block_q,
                      sum_dot=invariant and device.type != "cuda")


class TritonBackend:
    name = "triton"

    @classmethod
    def for_device(cls, device: torch.device) -> "TritonBackend":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend runs on CUDA, or on CPU only under "
                             "TRITON_INTERPRET=1 (slow: for tests)")
        kernel()  # import triton now: a missing or broken install fails at start-up
        return cls()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
        write_kv(kv_cache, meta.slot_mapping, k, v)
        heads, kv_heads, head_dim = q.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        plan: Optional[TritonPlan] = meta.backend_plan
        if plan is None:
            plan = meta.backend_plan = plan_step(meta, heads // kv_heads, q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        launch(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, plan,
               scale, out)
        return out


def launch(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: TritonPlan,
           scale: float, out: torch.Tensor) -> None:
    """Attend q [T, H, D] (last dim contiguous) over the paged cache into out [T, H, D]. All
    arguments are device tensors: no host synchronisation (graph-capturable)."""
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.is_contiguous()
    heads, kv_heads, head_dim = q.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    grid = (plan.tile_seq.shape[0], kv_heads)
    if grid[0] == 0:
        return
    kernel()[grid](
        q, kv_cache[0], kv_cache[1], out, block_tables, seq_lens, query_start_loc,
        plan.tile_seq, plan.tile_start, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        D_PAD=max(16, _next_pow2(head_dim)), BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=BLOCK_N,
        F32_DOT=q.dtype == torch.float32 or q.device.type != "cuda",
        SUM_DOT=plan.sum_dot)
