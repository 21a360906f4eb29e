"""Megatron-style tensor-parallel sharding of a loaded Llama-family `CausalLM`.

Rank r of `tp` ranks holds:

* attention: heads [r*H/tp, (r+1)*H/tp) and KV heads [r*KV/tp, (r+1)*KV/tp) of the fused
  `qkv_proj` (column-parallel: rows of q, k and v sliced separately), and the matching input
  columns of `o_proj` (row-parallel);
* MLP: intermediate units [r*I/tp, (r+1)*I/tp) of `gate_up_proj` (gate rows and up rows sliced
  separately) and the matching input columns of `down_proj` (row-parallel);
* everything else replicated: embedding, norms, rotary tables, LM head.

A row-parallel projection computes a partial sum on each rank; `RowParallelLinear` all-reduces
it (SUM over the group) and only then adds the bias, so the bias counts once. After each
all-reduce every rank holds the same hidden state, so ranks agree at every layer boundary.

The shard is an ordinary `CausalLM` built from a per-rank `ArchConfig` (`shard_arch`), so its
paged KV cache (allocated from that arch) holds only this rank's KV heads.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenweir.model.arch import ArchConfig
from tokenweir.model.llama import CausalLM


def check_shardable(arch: ArchConfig, tp_size: int) -> None:
    """ValueError unless heads, KV heads and the MLP width all split evenly over tp_size ranks
    (KV heads are never replicated: each rank must own at least one)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    for what, count in (("num_heads", arch.num_heads), ("num_kv_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
        if count % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's "
                             f"{what} ({count})")


def shard_arch(arch: ArchConfig, tp_size: int) -> ArchConfig:
    """The architecture one rank runs: 1/tp of the heads, KV heads and MLP width."""
    check_shardable(arch, tp_size)
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp_size,
                               num_kv_heads=arch.num_kv_heads // tp_size,
                               intermediate_size=arch.intermediate_size // tp_size)


class RowParallelLinear(nn.Module):
    """y = all_reduce_sum(x @ W_shard^T) + bias: the input-sharded half of a Megatron pair.

    `group` None means the default process group."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out if self.bias is None else out + self.bias


def _rows(block: int, rank: int) -> slice:
    return slice(rank * block, (rank + 1) * block)


def _qkv_rows(full: ArchConfig, local: ArchConfig, rank: int) -> torch.Tensor:
    """Row indices of the fused qkv parameter owned by `rank` (q rows, then k, then v)."""
    d = full.head_dim
    q_size, kv_size = full.num_heads * d, full.num_kv_heads * d
    q_local, kv_local = local.num_heads * d, local.num_kv_heads * d
    idx = torch.arange(q_size + 2 * kv_size)
    return torch.cat([idx[:q_size][_rows(q_local, rank)],
                      idx[q_size:q_size + kv_size][_rows(kv_local, rank)],
                      idx[q_size + kv_size:][_rows(kv_local, rank)]])


def _gate_up_rows(full: ArchConfig, local: ArchConfig, rank: int) -> torch.Tensor:
    """Row indices of the fused gate_up parameter owned by `rank` (gate rows, then up)."""
    i, i_local = full.intermediate_size, local.intermediate_size
    idx = torch.arange(2 * i)
    return torch.cat([idx[:i][_rows(i_local, rank)], idx[i:][_rows(i_local, rank)]])


def _shard_tensor(name: str, tensor: torch.Tensor, full: ArchConfig, local: ArchConfig,
                  rank: int) -> torch.Tensor:
    """This rank's part of parameter `name` of the full model (a copy, or the tensor itself
    when it is replicated)."""
    if ".qkv_proj." in name:
        return tensor.index_select(0, _qkv_rows(full, local, rank).to(tensor.device))
    if ".gate_up_proj." in name:
        return tensor.index_select(0, _gate_up_rows(full, local, rank).to(tensor.device))
    if name.endswith("o_proj.weight"):
        return tensor[:, _rows(local.num_heads * full.head_dim, rank)].contiguous()
    if name.endswith("down_proj.weight"):
        return tensor[:, _rows(local.intermediate_size, rank)].contiguous()
    return tensor  # replicated (row-parallel biases too: added once, after the reduce)


def shard_model(full_model: CausalLM, rank: int, tp_size: int,
                group: Optional[dist.ProcessGroup] = None) -> CausalLM:
    """Rank `rank`'s shard of a loaded model, on the full model's device and dtype.

    Replicated tensors are shared with `full_model`, not copied. The returned model's forward
    all-reduces over `group` (an initialized process group of `tp_size` ranks) twice per layer.
    tp_size == 1 returns `full_model` itself."""
    if tp_size == 1:
        return full_model
    full_arch = full_model.arch
    local = shard_arch(full_arch, tp_size)
    weight = full_model.lm_head_weight
    shard = CausalLM(local, device=torch.device("meta"), dtype=weight.dtype)
    for name, param in full_model.named_parameters():
        _set_parameter(shard, name, _shard_tensor(name, param.data, full_arch, local, rank))
    shard.model.rotary_emb = full_model.model.rotary_emb  # GGUF freq factors included
    for layer in shard.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.data, _data(attn.o_proj.bias), group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data, _data(mlp.down_proj.bias),
                                          group)
    return shard.eval().requires_grad_(False)


def _data(param: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
    return None if param is None else param.data


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter `name` (a meta placeholder) with `tensor`, checking its shape."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    placeholder = getattr(module, attr)
    if placeholder.shape != tensor.shape:
        raise ValueError(f"shard of {name!r} has shape {tuple(tensor.shape)}, the per-rank "
                         f"model expects {tuple(placeholder.shape)}")
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
