"""Model shapes from Hugging Face config.json files, and the table of shipped configs.

`shape_from_hf_config(config)` reads the fields the roofline needs from a config.json dict of
the Llama family (llama, mistral, qwen2, qwen3) or of its mixture-of-experts relatives
(mixtral, qwen2_moe, qwen3_moe): sizes, GQA (num_key_value_heads, head_dim), tied embeddings,
experts (num_local_experts or num_experts, num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size, decoder_sparse_step, mlp_only_layers), q/k/v biases (qwen2
family) and q/k norms (qwen3 family), and a sliding window where one is in use.

The shipped configs (tokenweir/sim/models/*.json) were written by hand from each model's
config.json on the Hugging Face hub, with the model card cited in `_source` and the
published parameter counts in `_published_params` / `_published_active_params` (tests hold
the counts computed here within 2% of them). Nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Mapping

from tokenweir.sim.shape import MODEL_SHAPES, ModelShape

MODELS_DIR = Path(__file__).parent / "models"

# model_type -> (q/k/v projections carry a bias, q and k are RMS-normed per head)
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False), "mistral": (False, False), "mixtral": (False, False),
    "qwen2": (True, False), "qwen2_moe": (True, False),
    "qwen3": (False, True), "qwen3_moe": (False, True),
}


def _require(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: config field {key!r} must be a positive integer, "
                         f"got {value!r}")
    return value


def _num_moe_layers(config: Mapping[str, Any], num_layers: int, num_experts: int) -> int:
    """Layers whose MLP is the experts: all of them (mixtral), or as Qwen-MoE places them
    (layer i is sparse when not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    if not num_experts:
        return 0
    step = config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or ())
    return sum(1 for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def _sliding_window(config: Mapping[str, Any]):
    """The window in use, or None (Qwen configs name one but switch it off)."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None
    return int(window)


def _moe_fields(config: Mapping[str, Any], num_layers: int, where: str) -> dict[str, int]:
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if not num_experts:
        return {}
    moe_inter = (config.get("moe_intermediate_size")
                 or _require(config, "intermediate_size", where))  # mixtral: the experts'
    return {"num_experts": int(num_experts),
            "num_experts_per_tok": _require(config, "num_experts_per_tok", where),
            "moe_intermediate_size": int(moe_inter),
            "shared_expert_intermediate_size":
                int(config.get("shared_expert_intermediate_size") or 0),
            "num_moe_layers": _num_moe_layers(config, num_layers, int(num_experts))}


def shape_from_hf_config(config: Mapping[str, Any], name: str = "model",
                         source: str = "") -> ModelShape:
    """A ModelShape from a config.json dict; ValueError naming the field when one is missing
    or the architecture is not one of the families above."""
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"{name}: model_type {model_type!r} is not supported; known: "
                         f"{sorted(_FAMILIES)}")
    hidden = _require(config, "hidden_size", name)
    heads = _require(config, "num_attention_heads", name)
    layers = _require(config, "num_hidden_layers", name)
    qkv_bias, qk_norm = _FAMILIES[model_type]
    return ModelShape(
        name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=_require(config, "intermediate_size", name),
        vocab_size=_require(config, "vocab_size", name),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(config),
        qkv_bias=qkv_bias or bool(config.get("attention_bias", False)), qk_norm=qk_norm,
        source=source or str(config.get("_source", "")),
        **_moe_fields(config, layers, name))


def load_model_config(path: "str | Path") -> ModelShape:
    """The shape of a config.json file (a Hugging Face model directory's, or a shipped one);
    a directory is read as its config.json."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model config {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {str(path)!r} is not JSON: {exc}") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return shape_from_hf_config(config, name, str(config.get("_source") or path))


def shipped_config_paths() -> dict[str, Path]:
    """Shipped config name (the file's stem) -> path."""
    return {p.stem: p for p in sorted(MODELS_DIR.glob("*.json"))}


def published_params(name: str) -> tuple[float, float]:
    """(total, active) parameters a shipped config's model card publishes (active = total for
    a dense model)."""
    config = json.loads(shipped_config_paths()[name].read_text())
    total = float(config["_published_params"])
    return total, float(config.get("_published_active_params", total))


def _table() -> dict[str, Callable[[], ModelShape]]:
    """Every shape a name picks: the built-in ones, then the shipped configs (read when
    picked)."""
    table: dict[str, Callable[[], ModelShape]] = {
        name: (lambda shape=shape: shape) for name, shape in MODEL_SHAPES.items()}
    for name, path in shipped_config_paths().items():
        table.setdefault(name, functools.partial(load_model_config, path))
    return table


# name -> a function returning its shape (`--model-shape` / `--model` choices)
MODEL_TABLE: dict[str, Callable[[], ModelShape]] = _table()
