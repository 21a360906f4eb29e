"""Architecture description shared by the model, the loader and the KV-cache allocator.

`ArchConfig` is a plain frozen dataclass: everything the decoder needs to build itself, read
either from a Hugging Face `config.json` dict or from GGUF metadata. Supported families are the
Llama-style decoders that differ only in small switches:

* LlamaForCausalLM (SmolLM2, Llama 2/3/3.1 incl. "llama3" rope scaling), MistralForCausalLM
* Qwen2ForCausalLM  -- bias on the q/k/v projections
* Qwen3ForCausalLM  -- per-head RMSNorm on q and k before RoPE
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

# HF `architectures[0]` -> family key; the family key is also accepted as `model_type`.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` values we can run (llama.cpp writes Mistral models as "llama").
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def _family_from_hf(cfg: Mapping[str, Any]) -> str:
    """The family key for an HF config dict; ValueError when unsupported."""
    archs = cfg.get("architectures") or []
    for name in archs:
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if not archs and model_type in _HF_ARCHITECTURES.values():
        return model_type
    shown = archs[0] if archs else model_type
    raise ValueError(
        f"Unsupported model architecture {shown!r}; supported: {sorted(_HF_ARCHITECTURES)}")


def _normalize_rope(cfg: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either transformers 5 `rope_parameters` or the legacy
    `rope_theta` + `rope_scaling` keys. rope_scaling is None for plain RoPE, otherwise a dict with
    a normalized `rope_type` key. Unsupported scaling types raise ValueError."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    merged: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    if isinstance(params, Mapping):
        merged.update(params)
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope scaling type {rope_type!r}; supported: "
                         f"{SUPPORTED_ROPE_TYPES[:3]}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in merged:
                raise ValueError(f"llama3 rope scaling is missing {key!r}")
        merged.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 8192))
    if rope_type == "linear" and "factor" not in merged:
        raise ValueError("linear rope scaling is missing 'factor'")
    merged["rope_type"] = rope_type
    return theta, merged


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    """Normalize an `eos_token_id` value (None, int or list) to a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclass(frozen=True)
class ArchConfig:
    """Shape and switches of a Llama-family decoder.

    head_dim is per attention head; num_heads must be a multiple of num_kv_heads (GQA).
    rope_scaling is None (plain RoPE) or a dict with `rope_type` in SUPPORTED_ROPE_TYPES.
    `sliding_window` is recorded for information; `max_position_embeddings` is already capped so
    that a context never exceeds it (the paged attention op has no window).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ArchConfig":
        """Build from a parsed Hugging Face config.json. Raises ValueError for unsupported
        architectures, activations or rope scaling types."""
        family = _family_from_hf(cfg)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Unsupported hidden_act {act!r}; only SiLU-gated MLPs are supported")
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _normalize_rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if window:
            max_pos = min(max_pos, int(window))
        return cls(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            qkv_bias=family == "qwen2" or (family != "mistral" and attention_bias),
            o_bias=family in ("llama", "qwen3") and attention_bias,
            mlp_bias=family == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any],
                           tensor_names: Iterable[str] = ()) -> "ArchConfig":
        """Build from GGUF key/value metadata (already decoded to Python values) and the names of
        the tensors in the file (used to detect tied embeddings, biases and rope frequency
        factors). Raises ValueError for unsupported architectures."""
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: "
                             f"{list(_GGUF_ARCHITECTURES)}")
        names = set(tensor_names)

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
        scaling = None
        if "rope_freqs.weight" in names:
            scaling = {"rope_type": "freq_factors"}
        elif get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif get("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"Unsupported GGUF rope scaling {get('rope.scaling.type')!r}")
        eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        bias = "blk.0.attn_q.bias" in names
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=int(get("attention.key_length") or get("rope.dimension_count")
                         or hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(get("context_length", 2048)),
            qkv_bias=bias,
            o_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
