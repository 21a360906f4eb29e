"""Paged KV cache and the attention op that reads it.

Cache contract (shared with the runner):

* `kv_caches[layer]` is ONE tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
  (index 0 = K, 1 = V) in the model dtype. Block 0 is the null block: never handed to a request,
  used to pad block tables.
* Token t of the flattened batch writes its K/V to slot `slot_mapping[t]`
  (= block_id * block_size + offset in block).
* Requests are ordered decodes first: the first `num_decodes` have query_len == 1; the rest are
  prefill chunks (query_len >= 1, possibly with an already cached prefix).

Per layer `paged_attention` writes this step's K/V into the cache (`index_copy_` on the flat
slot view), then

* on CPU in float32 or bfloat16 (AVX2 or AVX-512, picked at run time): the C++ kernel in
  `tokenweir/model/kernels` attends each request's blocks in place (no gather): all decodes in
  one call per layer, and the prefill chunks in another (up to PREFILL_IN_PLACE_MAX_ROWS
  rows per chunk on this instruction set; longer ones take the torch path). Elsewhere, or
  when the kernel cannot be built (no compiler, `TOKENWEIR_CPU_KERNELS=0`), the torch path
  below;
* decodes, torch path: batched. They are sorted by context length and cut into groups whose gathered K/V
  fit a few MiB; each group is gathered (`index_select` of whole blocks into a reused
  workspace, which stays cache-resident) and runs ONE SDPA call, padded to the group's longest
  context with a boolean key mask, the GQA group folded into the query axis (no KV repeat).
  With ~600-token contexts all 64 decodes of a step take a handful of calls per layer;
* each prefill chunk: one SDPA call. `is_causal=True` on the step's own K/V when nothing is
  cached before it; otherwise its blocks are gathered and a causal mask offset by the cached
  prefix length is used (`enable_gqa=True`, no KV repeat).

The per-step plan (index tensors, masks) is built once, at the first layer, and cached on the
`AttentionMetadata` object, so the other layers only do tensor work and never sync.

Batch-invariant mode (`AttentionMetadata.batch_invariant`, set by the runner under
`--batch-invariant`): every query row of the step, decode or prefill, any chunk length, goes to
the C++ kernel with `fixed_order`, so row r of a request reads keys [0, ctx + r] and reduces
them in one order (the one a decode at its position uses) whatever its chunk, its step's other
rows, a cached prefix or a recompute after preemption. Prefill rows still share work items of
16 rows (each K/V block read once per item); what keeps their sums fixed is in
paged_attention_impl.h ("Fixed order"). It needs the kernel (RuntimeError without it).
"""

from __future__ import annotations

import itertools
import math
import mmap
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tokenweir.model import kernels
from tokenweir.model.arch import ArchConfig
from tokenweir.model.transfer import host_long

# Gathered K+V bytes per decode SDPA call: small enough to stay in the last-level cache between
# the gather and the attention that reads it, large enough to keep the number of calls low.
DECODE_GROUP_BYTES = 4 << 20

# A prefill chunk (with or without a cached prefix) takes the in-place kernel up to this many
# query rows, per kernel instruction set; longer ones run SDPA (over gathered blocks when a
# prefix is cached), whose GEMMs win on big chunks on AVX2 (the kernel has no GEMM blocking).
# Measured with benchmarks/kernels.py (prefill section, interleaved A/B): on AVX2 (float32,
# 2 threads) the kernel is faster up to 32 rows and slower from 64 (46 vs 61-67 GFLOP/s). On
# AVX-512 (AMD EPYC Zen 5, 1 thread, chunks of 32-1024 rows with no cached prefix) the kernel
# ran 1.8-2.6x SDPA's is_causal speed in bfloat16 and 1.6-2.7x in float32: in place at every
# size. (Since then the AVX-512 BF16 variant's one-pass bfloat16 path doubled that: 600-730
# GFLOP/s at 2 threads on 256-2048-row chunks, benchmarks/prefill_attention.py.)
PREFILL_IN_PLACE_MAX_ROWS: dict[str, int] = {"avx2": 32, "avx512": 1 << 30,
                                              "avx512bf16": 1 << 30}


def allocate_kv_caches(arch: ArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str,
                       pin_memory: bool = False) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer
    (`pin_memory`: page-locked host memory, for asynchronous copies to and from CUDA).

    Plain host pools are zero pages the kernel hands out on first touch (`_lazy_zeros`): a
    block's memory is faulted in when a step first writes it, not all at start-up (torch.zeros
    of the default 1 GiB pool took 0.3-1 s of every start). RSS therefore grows toward the
    pool's size as blocks are first used."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if torch.device(device).type == "cpu" and not pin_memory:
        return [_lazy_zeros(shape, dtype) for _ in range(arch.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            for _ in range(arch.num_layers)]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, writable, page-aligned host tensor over an anonymous private mapping
    (the tensor's storage keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype,
                            count=math.prod(shape)).view(shape)


def kv_cache_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


@dataclass
class _DecodeGroup:
    """Decodes attended in one SDPA call: positions [start, end) of the length-sorted decodes."""

    start: int
    end: int
    block_ids: torch.Tensor  # [n * nblk] their block tables, flattened
    mask: torch.Tensor  # [n, 1, 1, nblk * block_size] additive (0 / -inf), in the q dtype


@dataclass
class _PrefillPlan:
    """One prefill chunk: query rows [start, end) of the flattened batch."""

    start: int
    end: int
    ctx_before: int  # tokens cached before this chunk
    in_place: bool = False  # attended by the C++ kernel (with the decodes' or its own call)
    block_ids: Optional[torch.Tensor] = None  # [nblk] blocks covering the context (prefix only)
    mask: Optional[torch.Tensor] = None  # [q_len, nblk * block_size] additive, prefix only


@dataclass
class _StepPlan:
    """Everything derived from the metadata that all layers share."""

    block_size: int
    num_decodes: int = 0
    # C++ kernel path (CPU, float32/bfloat16): the whole step's int64 tables, read in place
    kernel: Optional[object] = None
    tables: Optional[torch.Tensor] = None
    query_start_loc: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    decode_reqs: Optional[torch.Tensor] = None  # arange(num_decodes)
    in_place_prefill_reqs: Optional[torch.Tensor] = None  # request indices, None: none
    decode_order: Optional[torch.Tensor] = None  # decodes sorted by length (None: already are)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    prefills: list[_PrefillPlan] = field(default_factory=list)
    # batch-invariant mode: every request's rows, to the kernel in fixed order
    fixed_order_reqs: Optional[torch.Tensor] = None


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch (see module docstring for the contract).

    query_start_loc: LongTensor[B+1], cumulative query lengths.
    seq_lens:        LongTensor[B], context length AFTER this step (cached + this step's tokens).
    block_tables:    Int/LongTensor[B, max_blocks], padded with 0 (the null block).
    slot_mapping:    LongTensor[T], cache slot of each token.
    query_lens_cpu, seq_lens_cpu: the same lengths as Python lists.
    num_decodes:     the first num_decodes requests have query_len == 1.
    backend:         the attention backend that runs this step (tokenweir/model/backends);
                     None: this module's own path (the CPU kernels, else batched SDPA).
    backend_plan:    what the backend derived from this metadata at the first layer.
    batch_invariant: attend every row alone, in one order (see the module docstring).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    backend: Optional[object] = field(default=None, compare=False)
    backend_plan: Optional[object] = field(default=None, repr=False, compare=False)
    batch_invariant: bool = False
    _plan: Optional[_StepPlan] = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    def plan(self, kv_cache: torch.Tensor) -> _StepPlan:
        """The step plan, built on first use and cached: all layers share the cache geometry
        and dtype (the masks are built in it)."""
        if self._plan is None or self._plan.block_size != kv_cache.shape[2]:
            self._plan = _build_plan(self, kv_cache)
        return self._plan


def build_attention_metadata(query_lens: Sequence[int], context_lens_before: Sequence[int],
                             block_tables_lists: Sequence[Sequence[int]], block_size: int,
                             device: torch.device | str, backend: Optional[object] = None,
                             batch_invariant: bool = False) -> AttentionMetadata:
    """Metadata for one step. Request i schedules query_lens[i] tokens at positions
    context_lens_before[i] .. context_lens_before[i] + query_lens[i] - 1, using the blocks
    block_tables_lists[i] (which must cover all of them). Requests with query_len == 1 must come
    first (the leading run of them is counted as decodes). `backend` runs the step's attention
    (see AttentionMetadata); `batch_invariant` asks for the batch-invariant path (no backend,
    or the triton one: backends/triton_paged.py, plan_step).
    On CUDA the tables travel in one pinned, non-blocking copy."""
    if batch_invariant and backend is not None and getattr(backend, "name", None) != "triton":
        raise ValueError(f"batch-invariant attention runs on the CPU kernels' path or the "
                         f"triton backend, not on the {getattr(backend, 'name', backend)!r} "
                         f"backend")
    query_lens, ctx = list(query_lens), list(context_lens_before)
    if not (len(query_lens) == len(ctx) == len(block_tables_lists)):
        raise ValueError("query_lens, context_lens_before and block tables differ in length")
    num_decodes = _leading_ones(query_lens)
    seq_lens = [c + q for c, q in zip(ctx, query_lens)]
    width = max(map(len, block_tables_lists), default=0) or 1
    if min(map(len, block_tables_lists), default=1) < _blocks_for(max(seq_lens, default=0),
                                                                   block_size):
        _check_tables(block_tables_lists, seq_lens, block_size)
    slots = _slots(block_tables_lists, ctx, query_lens, num_decodes, block_size)
    flat: list[int] = []
    for blocks in block_tables_lists:
        flat += blocks
        if len(blocks) < width:
            flat += [0] * (width - len(blocks))
    starts = [0, *itertools.accumulate(query_lens)]
    start_loc, lens, tables, slot_mapping = to_device_long(
        [starts, seq_lens, flat, slots], device)
    return AttentionMetadata(
        query_start_loc=start_loc, seq_lens=lens,
        block_tables=tables.reshape(len(block_tables_lists), width), slot_mapping=slot_mapping,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, num_decodes=num_decodes,
        backend=backend, batch_invariant=batch_invariant)


def _leading_ones(query_lens: list[int]) -> int:
    """How many leading entries are 1 (the decodes)."""
    if query_lens and query_lens[-1] == 1 and query_lens.count(1) == len(query_lens):
        return len(query_lens)
    num = 0
    while num < len(query_lens) and query_lens[num] == 1:
        num += 1
    return num


def _check_tables(tables: Sequence[Sequence[int]], seq_lens: list[int], block_size: int) -> None:
    """ValueError naming the first table too short for its tokens."""
    for blocks, n in zip(tables, seq_lens):
        if _blocks_for(n, block_size) > len(blocks):
            raise ValueError(f"block table of {len(blocks)} blocks is too short for {n} tokens")


def _slots(tables: Sequence[Sequence[int]], ctx: list[int], query_lens: list[int],
           num_decodes: int, block_size: int) -> list[int]:
    """The cache slot of every token of the step, in order: a decode's one token by one
    expression per row, a prefill chunk's by a range."""
    slots = [blocks[c // block_size] * block_size + c % block_size
             for blocks, c in zip(tables[:num_decodes], ctx[:num_decodes])]
    for blocks, c, q in zip(tables[num_decodes:], ctx[num_decodes:], query_lens[num_decodes:]):
        slots.extend(blocks[p // block_size] * block_size + p % block_size
                     for p in range(c, c + q))
    return slots


def to_device_long(lists: Sequence[Sequence[int]], device: torch.device | str
                   ) -> list[torch.Tensor]:
    """int64 device tensors of these lists. On CUDA: packed into ONE pinned host tensor and
    copied with non_blocking (no host synchronisation; the caching host allocator keeps the
    pinned memory alive until the copy has run), then split into views."""
    device = torch.device(device)
    if device.type != "cuda":
        return [host_long(xs).to(device) for xs in lists]
    sizes = [len(xs) for xs in lists]
    packed = host_long([x for xs in lists for x in xs]).pin_memory()
    return list(packed.to(device, non_blocking=True).split(sizes))


def _blocks_for(n_tokens: int, block_size: int) -> int:
    return (n_tokens + block_size - 1) // block_size


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive float mask, so SDPA does not convert it per call."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def _build_plan(meta: AttentionMetadata, kv_cache: torch.Tensor) -> _StepPlan:
    """Index tensors and masks for the step; only small tensors, built once per step."""
    block_size, dtype = kv_cache.shape[2], kv_cache.dtype
    bytes_per_token = 2 * kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    plan = _StepPlan(block_size=block_size, num_decodes=meta.num_decodes)
    device = meta.slot_mapping.device
    tables = meta.block_tables.to(torch.long)
    nd = meta.num_decodes
    plan.kernel = paged_kernel_for(kv_cache)
    if meta.batch_invariant:
        return _fixed_order_plan(plan, meta, tables)
    if plan.kernel is not None:
        plan.tables = tables.contiguous()
        plan.query_start_loc = meta.query_start_loc.to(torch.long).contiguous()
        plan.seq_lens = meta.seq_lens.to(torch.long).contiguous()
        plan.decode_reqs = torch.arange(nd, dtype=torch.long, device=device)
    elif nd:
        _plan_decodes(plan, meta.seq_lens_cpu[:nd], tables[:nd], bytes_per_token, dtype)
    in_place: list[int] = []
    max_rows = in_place_max_rows(plan.kernel)
    start = nd
    for i in range(nd, len(meta.query_lens_cpu)):
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        p = _PrefillPlan(start=start, end=start + q_len, ctx_before=seq_len - q_len)
        if plan.kernel is not None and q_len <= max_rows:
            p.in_place = True
            in_place.append(i)
        elif p.ctx_before > 0:
            nblk = _blocks_for(seq_len, block_size)
            p.block_ids = tables[i, :nblk]
            keys = torch.arange(nblk * block_size, device=device)
            rows = torch.arange(q_len, device=device) + p.ctx_before
            p.mask = _additive(keys[None, :] <= rows[:, None], dtype)
        plan.prefills.append(p)
        start += q_len
    if in_place:
        plan.in_place_prefill_reqs = torch.tensor(in_place, dtype=torch.long, device=device)
    return plan


def _fixed_order_plan(plan: _StepPlan, meta: AttentionMetadata,
                      tables: torch.Tensor) -> _StepPlan:
    """The batch-invariant plan: every request's rows to the kernel, in fixed order."""
    if plan.kernel is None:
        raise RuntimeError("batch-invariant attention needs the C++ CPU kernels (CPU, float32 or "
                           "bfloat16, head_dim a multiple of the vector width)")
    plan.tables = tables.contiguous()
    plan.query_start_loc = meta.query_start_loc.to(torch.long).contiguous()
    plan.seq_lens = meta.seq_lens.to(torch.long).contiguous()
    plan.fixed_order_reqs = torch.arange(len(meta.query_lens_cpu), dtype=torch.long,
                                     device=meta.slot_mapping.device)
    return plan


def in_place_max_rows(kernel) -> int:
    """The longest prefill chunk `kernel` (paged_kernel_for's answer) takes in place: its
    instruction set's entry of PREFILL_IN_PLACE_MAX_ROWS (0 without a kernel)."""
    if kernel is None:
        return 0
    return PREFILL_IN_PLACE_MAX_ROWS.get(getattr(kernel, "isa", ""), 1 << 30)


def paged_kernel_for(kv_cache: torch.Tensor):
    """The C++ in-place paged attention when it applies to this cache (CPU, float32 or
    bfloat16, contiguous, head_dim a multiple of the vector width, kernels available on this
    CPU), else None."""
    if (kv_cache.device.type != "cpu" or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or not kv_cache.is_contiguous() or kv_cache.shape[-1] % 8):
        return None
    kernel = kernels.paged_attention_kernel()
    if kernel is None or kv_cache.shape[-1] % kernels.vector_floats(kernel.isa):
        return None
    return kernel


def _plan_decodes(plan: _StepPlan, seq_lens: list[int], tables: torch.Tensor,
                  bytes_per_token: int, dtype: torch.dtype) -> None:
    """Sort decodes by context length and cut them into groups of bounded gathered size, each
    padded only to its own longest context."""
    bs, device = plan.block_size, tables.device
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    order_t = torch.tensor(order, dtype=torch.long, device=device)
    if order != list(range(len(order))):
        plan.decode_order = order_t
    i = 0
    while i < len(order):
        j = i + 1  # grow while the group (padded to its longest = last member) fits the budget
        while j < len(order) and ((j + 1 - i) * _blocks_for(seq_lens[order[j]], bs) * bs
                                  * bytes_per_token) <= DECODE_GROUP_BYTES:
            j += 1
        nblk = _blocks_for(seq_lens[order[j - 1]], bs)
        members = order_t[i:j]
        lens = torch.tensor([seq_lens[m] for m in order[i:j]], device=device)
        keys = torch.arange(nblk * bs, device=device)
        plan.decode_groups.append(_DecodeGroup(
            start=i, end=j, block_ids=tables.index_select(0, members)[:, :nblk].reshape(-1),
            mask=_additive(keys[None, :] < lens[:, None], dtype).view(j - i, 1, 1, -1)))
        i = j


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at the given flat slots of the layer's cache."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


_WORKSPACE = threading.local()


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """kv_cache[:, block_ids] -> [2, n, bs, kvh, d], written into a grow-only per-thread buffer
    reused across layers and steps (fresh large allocations page-fault on every use). The
    result is only valid until the next call."""
    shape = (2, block_ids.numel(), *kv_cache.shape[2:])
    numel = 2 * block_ids.numel() * kv_cache[0, 0].numel()
    key = (kv_cache.device, kv_cache.dtype)
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACE.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
    return torch.index_select(kv_cache, 1, block_ids, out=buf[:numel].view(shape))


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan,
                      scale: float, out: torch.Tensor) -> None:
    """q [T, H, D]: attend the first plan.num_decodes rows (one query per request), writing
    into out [T, H, D] (both contiguous on the kernel path)."""
    nd = plan.num_decodes
    if not nd:
        return
    if plan.kernel is not None:  # reads K/V in place
        plan.kernel(q, kv_cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                    plan.decode_reqs, scale, out)
        return
    _, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group_size = num_heads // kv_heads
    order = plan.decode_order
    qd = q[:nd] if order is None else q[:nd].index_select(0, order)
    od = out[:nd] if order is None else torch.empty_like(qd)
    for g in plan.decode_groups:
        n = g.end - g.start
        kv = _gather_blocks(kv_cache, g.block_ids)
        kv = kv.view(2, n, -1, kv_heads, head_dim).transpose(2, 3)  # [2, n, kvh, L, d]
        # Fold the GQA group into the query axis: query heads kvh*G .. kvh*G+G-1 share kv head
        # kvh, so [n, H, D] -> [n, kvh, G, D] attends [n, kvh, L, D] directly.
        qg = qd[g.start:g.end].view(n, kv_heads, group_size, head_dim)
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.mask, scale=scale)
        # SDPA's output layout is the backend's (CUDA's memory-efficient one returns [n, G,
        # kvh, D] memory viewed as [n, kvh, G, D]): copy into the rows' view, never `.view` it.
        od[g.start:g.end].view(n, kv_heads, group_size, head_dim).copy_(o)
    if order is not None:
        out[:nd].index_copy_(0, order, od)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, p: _PrefillPlan, scale: float) -> torch.Tensor:
    """One chunk: q [n, H, D], its own k/v [n, KVH, D] -> [n, H, D] (causal)."""
    qh = q.transpose(0, 1).unsqueeze(0)
    if p.ctx_before == 0:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        kv = _gather_blocks(kv_cache, p.block_ids)
        kv = kv.view(2, 1, -1, kv_cache.shape[3], kv_cache.shape[4]).transpose(2, 3)
        out = F.scaled_dot_product_attention(qh, kv[0], kv[1], attn_mask=p.mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of this step's queries over each request's cached context.

    q [T, H, D]; k, v [T, KVH, D] (after RoPE / q-k norm); kv_cache is the layer's cache.
    Writes k, v at meta.slot_mapping first. Returns [T, H, D] in q's dtype. The step's
    backend runs it when the metadata names one (tokenweir/model/backends)."""
    if meta.backend is not None:
        return meta.backend.forward(q, k, v, kv_cache, meta, scale)
    write_kv(kv_cache, meta.slot_mapping, k, v)
    plan = meta.plan(kv_cache)
    if plan.kernel is not None:
        q = q.contiguous()
    out = torch.empty_like(q)
    if plan.fixed_order_reqs is not None:
        plan.kernel(q, kv_cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                    plan.fixed_order_reqs, scale, out, fixed_order=True)
        return out
    _decode_attention(q, kv_cache, plan, scale, out)
    if plan.in_place_prefill_reqs is not None:
        plan.kernel(q, kv_cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                    plan.in_place_prefill_reqs, scale, out)
    for p in plan.prefills:
        if not p.in_place:
            out[p.start:p.end] = _prefill_attention(q[p.start:p.end], k[p.start:p.end],
                                                    v[p.start:p.end], kv_cache, p, scale)
    return out
