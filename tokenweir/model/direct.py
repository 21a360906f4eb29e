"""The decoder stack as direct calls, for CPU steps.

A batch-1 decode step of SmolLM2-135M (bfloat16, AVX-512 BF16 machine) took ~10 ms, ~2 of them
in Python: some 210 module calls, each Linear routing its input (int8? packed? oneDNN? padded?)
and looking its packed weight up, each fused op asking whether the kernels apply. None of that
changes between steps of the same shape. `DirectStack` resolves it once per (dtype, row class):
every Linear bound to its op on its packed weight (`Linear.bind`: one class per row count up to
EXACT_ROWS, one for every count above), the fused ops module fetched once. It then runs each
layer as the calls the modules make, in the same order on the same inputs, so its results are
the module path's bit for bit (tests/model/test_direct.py).

It applies to a step when: CPU, float32 or bfloat16, the compiled fused ops available, every
layer a plain Llama layer (fused qkv and gate/up `Linear`s, no q/k norm: a tensor-parallel
shard's row-parallel projections keep the module path). Otherwise `LlamaModel` runs its
modules, as it always can. `TOKENWEIR_DIRECT_FORWARD=0` turns it off (to measure the
difference).

Contract with the weights: a stack is cached on the model per (dtype, row class, kernel env,
packing switches) and checked at every use against each Linear weight's storage and version (an
in-place write or a new tensor rebuilds it); `drop_packed_weights` and `set_quantization` drop
it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from tokenweir.model import kernels, layers
from tokenweir.model.attention import AttentionMetadata, paged_attention
from tokenweir.model.layers import DIRECT_ATTR, GatedMLP, Linear, RMSNorm

ENABLED = os.environ.get("TOKENWEIR_DIRECT_FORWARD", "1") != "0"

MatMul = Callable[[torch.Tensor], torch.Tensor]


class _Layer:
    """One decoder layer's bound ops and the norm weights it passes to the fused ops."""

    __slots__ = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")

    def __init__(self, layer: Any, ops: tuple[MatMul, MatMul, MatMul, MatMul]) -> None:
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.qkv, self.o, self.gate_up, self.down = ops


class DirectStack:
    """The layers of one LlamaModel bound for inputs of one dtype and row count."""

    def __init__(self, model: Any, ops: Any, layers: list[_Layer],
                 weights: list[torch.Tensor]) -> None:
        attn = model.layers[0].self_attn
        self.ops = ops
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.scale = attn.q_size, attn.scale
        self.eps = model.layers[0].input_layernorm.eps
        self.final_norm = model.norm.weight
        self._weights = weights
        self._stamp = _stamp(weights)

    def valid(self) -> bool:
        """Whether every bound weight is still the one (storage and version) it was bound to."""
        return _stamp(self._weights) == self._stamp

    def run(self, residual: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
            kv_caches: list[torch.Tensor], rope: Any,
            layer_hook: Optional[Callable[[int], None]]) -> torch.Tensor:
        """LlamaModel.forward after the embedding; `residual` is the embedded input (updated in
        place). The calls and their order are DecoderLayer's, Attention's and GatedMLP's."""
        ops, eps, t = self.ops, self.eps, residual.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        cos, sin = rope.cos_cached, rope.sin_cached
        delta: Optional[torch.Tensor] = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer_hook is not None:
                layer_hook(index)
            x = ops.add_rmsnorm(delta, residual, layer.input_norm, eps)
            qkv = layer.qkv(x).view(t, h + 2 * kvh, d)
            ops.rotary_inplace(qkv, h + kvh, d, positions, cos, sin)
            out = paged_attention(qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:], kv_cache,
                                  attn, self.scale)
            x = ops.add_rmsnorm(layer.o(out.reshape(t, self.q_size)), residual,
                                layer.post_norm, eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
        return ops.add_rmsnorm(delta, residual, self.final_norm, eps)


def _stamp(weights: list[torch.Tensor]) -> list[tuple[int, Optional[int]]]:
    return [(w.data_ptr(), None if w.is_inference() else w._version) for w in weights]


def direct_stack(model: Any, residual: torch.Tensor,
                 positions: torch.Tensor) -> Optional[DirectStack]:
    """The cached stack for this step's input (`residual`, the embedded tokens), built on first
    use; None when the direct path does not apply (see the module docstring)."""
    rows = residual.shape[0]
    if (not ENABLED or residual.device.type != "cpu"
            or residual.dtype not in (torch.float32, torch.bfloat16)
            or positions.dtype != torch.long or not positions.is_contiguous()):
        return None
    key = (residual.dtype, rows if rows <= layers.EXACT_ROWS else -1,
           os.environ.get("TOKENWEIR_CPU_KERNELS"), os.environ.get("TOKENWEIR_CPU_ISA"),
           layers.PACK_LINEAR, layers.BUCKET_ROWS)
    stacks = model.__dict__.setdefault(DIRECT_ATTR, {})
    stack = stacks.get(key, False)
    if stack is False or (stack is not None and not stack.valid()):
        stack = stacks[key] = _build(model, residual)
    return stack


def _build(model: Any, probe: torch.Tensor) -> Optional[DirectStack]:
    """Bind every layer for inputs like `probe` [rows, hidden]; None if any part cannot be."""
    ops = kernels.fused_ops()
    if ops is None or not _plain_norm(model.norm, probe.dtype):
        return None
    layers, weights = [], []
    rows = probe.shape[0]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None),
                   getattr(mlp, "down_proj", None))
        if (attn.qk_norm or type(mlp) is not GatedMLP
                or any(type(lin) is not Linear for lin in linears)
                or not _plain_norm(layer.input_layernorm, probe.dtype)
                or not _plain_norm(layer.post_attention_layernorm, probe.dtype)):
            return None
        bound = [lin.bind(probe.new_empty((rows, lin.in_features))) for lin in linears]
        if any(op is None for op in bound):
            return None
        layers.append(_Layer(layer, tuple(bound)))
        weights += [lin.weight for lin in linears]
    return DirectStack(model, ops, layers, weights)


def _plain_norm(norm: Any, dtype: torch.dtype) -> bool:
    return type(norm) is RMSNorm and norm.weight.dtype == dtype
