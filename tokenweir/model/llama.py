"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) running on the paged KV cache.

`CausalLM.forward(input_ids[T], positions[T], attn, kv_caches) -> hidden[T, hidden]` runs ONE
flattened, unpadded forward over every token scheduled in a step; `compute_logits` turns the
rows the runner wants to sample into float32 logits.

Weights: q/k/v are fused into `qkv_proj`, gate/up into `gate_up_proj`. `load_weights` takes
Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`, ...) and copies each
tensor into its slice of the fused parameter, or a fused parameter's own name with the whole
(`fuse_checkpoint` makes those: the load cache stores them).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenweir.model.arch import ArchConfig
from tokenweir.model.attention import AttentionMetadata, paged_attention
from tokenweir.model.direct import direct_stack
from tokenweir.model.layers import (PACKED_MAX_ROWS_LM_HEAD, SKINNY_MAX_ROWS_LM_HEAD,
                                    Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding,
                                    RotaryStep, batch_invariant, bucketed_linear,
                                    drop_packed_weights, few_rows_matmul, int8_matmul,
                                    invariant_matmul)


# Called with the layer index before each decoder layer (an attention-layer boundary). It may
# raise to unwind the forward pass; the layers before `index` have then written their K/V.
LayerHook = Callable[[int], None]


class Attention(nn.Module):
    """Self-attention with fused qkv projection, optional q/k bias (Qwen2), optional per-head
    q/k RMSNorm before RoPE (Qwen3), GQA, and the paged KV cache."""

    def __init__(self, arch: ArchConfig, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=arch.qkv_bias, **kw)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias, **kw)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, rope: RotaryStep, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into kv_cache."""
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, d)
        v = qkv[:, h + kvh:]
        if self.qk_norm:
            q = rope.rotate(self.q_norm(qkv[:, :h]))
            k = rope.rotate(self.k_norm(qkv[:, h:h + kvh]))
        else:  # rotate q and k together, in place: one op
            rope.rotate_leading_heads_(qkv, h + kvh)
            q, k = qkv[:, :h], qkv[:, h:h + kvh]
        out = paged_attention(q, k, v, kv_cache, attn, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), written (as in vLLM) as
    `forward(delta, residual) -> (delta', residual)`: the running sum lives in `residual`
    (updated in place) and each residual add is fused with the norm that follows it."""

    def __init__(self, arch: ArchConfig, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.self_attn = Attention(arch, **kw)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, **kw)

    def forward(self, delta: Optional[torch.Tensor], residual: torch.Tensor, rope: RotaryStep,
                attn: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input is residual + delta (delta None: residual alone); returns the
        MLP output as the next delta, and residual holding the sum before it."""
        h = self.input_layernorm.add_forward(delta, residual)
        h = self.post_attention_layernorm.add_forward(
            self.self_attn(h, rope, attn, kv_cache), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, arch: ArchConfig, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(arch, **kw) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                          arch.rope_theta, arch.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata, kv_caches: list[torch.Tensor],
                layer_hook: Optional[LayerHook] = None) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)  # a fresh tensor: updated in place below
        direct = direct_stack(self, residual, positions)
        if direct is not None:  # small CPU steps: the same calls without the modules' routing
            return direct.run(residual, positions, attn, kv_caches, self.rotary_emb, layer_hook)
        rope = self.rotary_emb.for_step(positions, residual.dtype)
        delta: Optional[torch.Tensor] = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer_hook is not None:
                layer_hook(index)
            delta, residual = layer(delta, residual, rope, attn, kv_cache)
        return self.norm.add_forward(delta, residual)


# HF name suffix -> (our parameter suffix, shard index into the fused parameter or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_FUSED_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}


def fuse_checkpoint(items: Iterable[tuple[str, Any]],
                    combine: Callable[[list[Any]], Any]) -> Iterator[tuple[str, Any]]:
    """(HF name, value) pairs with each layer's q/k/v and gate/up parts replaced by one pair
    under our fused parameter's name (`model.layers.3.self_attn.qkv_proj.weight`), whose value
    is combine(parts in shard order), yielded where its last part was; every other pair as it
    comes. Parts of an incomplete group are yielded unfused at the end, in arrival order.
    `load_weights` takes both forms; the load cache stores the fused one, which a float32 load
    adopts without a copy. The order depends only on the names, so the same stream of shapes
    and of tensors fuse alike."""
    pending: dict[str, list[Optional[tuple[str, Any]]]] = {}
    for name, value in items:
        m = _LAYER_RE.match(name)
        fused, shard = _FUSED.get(m.group(2), (None, None)) if m else (None, None)
        if fused is None:
            yield name, value
            continue
        key = f"model.layers.{m.group(1)}.{fused}.{m.group(3)}"
        parts = pending.setdefault(key, [None] * _FUSED_PARTS[fused])
        parts[shard] = (name, value)
        if all(part is not None for part in parts):
            del pending[key]
            yield key, combine([part[1] for part in parts])
    for parts in pending.values():
        yield from (part for part in parts if part is not None)


class CausalLM(nn.Module):
    """The decoder plus LM head. `lm_head` shares the embedding matrix when the architecture
    ties them."""

    def __init__(self, arch: ArchConfig, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        """Parameters are allocated UNINITIALIZED (except norms = 1): call `load_weights`."""
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, device, dtype)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False, device=device,
                                  dtype=dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata, kv_caches: list[torch.Tensor],
                layer_hook: Optional[LayerHook] = None) -> torch.Tensor:
        """input_ids, positions: LongTensor[T] of the flattened step (requests in the order of
        `attn`). Returns the final-norm hidden states [T, hidden] in the model dtype.
        `layer_hook`, when given, runs before every decoder layer (see LayerHook)."""
        return self.model(input_ids, positions, attn, kv_caches, layer_hook)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]. On CPU, above the few-rows kernels'
        sizes, the result is a view of a buffer the next call overwrites (`logits_buffer`):
        use it (sampling, logprobs) before computing logits again."""
        weight = self.lm_head_weight
        if batch_invariant(self):  # float32 sums in one order per row, whatever the rows
            return invariant_matmul(hidden, weight, self, out_dtype=torch.float32)
        logits = int8_matmul(hidden, weight, self)
        if logits is not None:
            return logits.float()
        logits = few_rows_matmul(hidden, weight, self, PACKED_MAX_ROWS_LM_HEAD,
                                 SKINNY_MAX_ROWS_LM_HEAD)
        if logits is not None:
            return logits
        out = logits_buffer(self, hidden.shape[0], weight.shape[0], hidden.device)
        if hidden.dtype == torch.float32:
            return torch.matmul(hidden, weight.t(), out=out) if out is not None else \
                torch.matmul(hidden, weight.t())
        logits = bucketed_linear(hidden, weight, owner=self)  # rows bucketed: bounded memory
        return out.copy_(logits) if out is not None else logits.float()

    # ---- weights ---------------------------------------------------------------------------
    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """Row range [start, end) of shard `shard` inside fused parameter `fused`."""
        a = self.arch
        if fused.endswith("qkv_proj"):
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = a.intermediate_size
        return (shard * i, (shard + 1) * i)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (hf_name, tensor) pairs into the parameters (casting dtype/device); a whole,
        contiguous parameter already in the right dtype and device is taken as it is, without a
        copy (the tensors a loader yields are the model's from then on: nothing else may write
        them).

        Returns the names written (`name@row` for a shard of a fused parameter), for
        `check_loaded`. Unknown names raise KeyError, shape mismatches ValueError; rotary
        `inv_freq` buffers and a tied `lm_head.weight` are skipped. The special name
        `rope_freqs` (GGUF frequency factors) rescales the rotary table."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "rope_freqs":
                self.model.rotary_emb.set_freq_factors(tensor)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, rows = self._map_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[target]
            dest = param.data if rows is None else param.data[rows[0]:rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}"
                                 f" vs model {tuple(dest.shape)}")
            if rows is None and _adoptable(tensor, dest):
                param.data = tensor  # no copy: e.g. a view of the load cache's private mapping
            else:
                with torch.no_grad():
                    dest.copy_(tensor)
            loaded.add(target if rows is None else f"{target}@{rows[0]}")
        drop_packed_weights(self)  # `.data` writes bump no version: repack from the new weights
        return loaded

    def _map_name(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Our parameter name and fused row range (or None) for an HF name."""
        m = _LAYER_RE.match(name)
        if m:
            layer, module, kind = m.groups()
            if module in _FUSED:
                fused, shard = _FUSED[module]
                rows = self._shard_rows(fused, shard)
                return f"model.layers.{layer}.{fused}.{kind}", rows
        return name, None

    def check_loaded(self, loaded: set[str]) -> None:
        """Raise ValueError naming parameters (or fused shards) that load_weights never wrote."""
        expected = set()
        for name in dict(self.named_parameters()):
            module = name.rsplit(".", 1)[0]
            shards = [f[0] for f in _FUSED.values() if module.endswith(f[0])]
            if not shards:
                expected.add(name)
                continue
            n = 3 if shards[0].endswith("qkv_proj") else 2
            expected.update(f"{name}@{self._shard_rows(shards[0], i)[0]}" for i in range(n))
        missing = sorted(name for name in expected - loaded  # a fused parameter written whole
                         if name.split("@")[0] not in loaded)  # holds all of its shards
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _adoptable(tensor: torch.Tensor, dest: torch.Tensor) -> bool:
    """Whether load_weights may make `tensor` the parameter's storage instead of copying it."""
    return (tensor.dtype == dest.dtype and tensor.device == dest.device
            and tensor.is_contiguous() and not tensor.requires_grad)


def logits_buffer(owner, rows: int, vocab: int, device: torch.device) -> Optional[torch.Tensor]:
    """[rows, vocab] float32 in a buffer kept on `owner` across calls (grown when needed), on
    CPU; None elsewhere (CUDA's caching allocator reuses memory already). Float32 logits of more
    than ~170 rows of a 49k vocabulary exceed glibc's 32 MB mmap threshold, so a fresh tensor
    each step is a fresh mapping that page-faults on first touch: 200 rows took 22 ms instead
    of 14 (SmolLM2, AVX-512 BF16 machine)."""
    if device.type != "cpu":
        return None
    buffer = getattr(owner, "_logits", None)
    if (buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab
            or buffer.device != device):
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            buffer = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        owner._logits = buffer
    return buffer[:rows]
