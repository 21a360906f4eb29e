"""The per-request SDPA reference backend: one SDPA call per request, over its blocks gathered
into a dense [ctx, KVH, D] K/V, with the causal mask offset by the cached prefix. Slow by
design (a loop over requests, a gather each); the other backends are tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenweir.model.attention import write_kv


class ReferenceBackend:
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
        write_kv(kv_cache, meta.slot_mapping, k, v)
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            slots = _context_slots(meta.block_tables[i], seq_len, block_size)
            keys = flat[0].index_select(0, slots).transpose(0, 1)  # [KVH, ctx, D]
            values = flat[1].index_select(0, slots).transpose(0, 1)
            query = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            rows = torch.arange(seq_len - q_len, seq_len, device=q.device)
            allowed = torch.arange(seq_len, device=q.device)[None, :] <= rows[:, None]
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed,
                                               scale=scale, enable_gqa=True)
            out[start:start + q_len].copy_(o.transpose(0, 1))
            start += q_len
        return out


def _context_slots(table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0 .. seq_len - 1 of one request."""
    positions = torch.arange(seq_len, device=table.device)
    return table.to(torch.long)[positions // block_size] * block_size + positions % block_size
