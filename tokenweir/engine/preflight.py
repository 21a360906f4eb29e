"""Checks of an engine configuration that need the model's context length but not its
weights, run before anything heavy loads (torch-free: the CLI runs them before importing
torch, LLMEngine before loading the model), so that a bad argument costs milliseconds, not a
model load.

Every refusal is a ConfigError: a ValueError naming the engine field at fault, whose text can
be spelled for Python callers (`num_gpu_blocks_override=64`) or for the command line
(`--num-gpu-blocks-override 64`), fix included.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from tokenweir.config import EngineConfig

Spell = Callable[[str, Any], str]  # (field, value) -> how the user writes that setting


def python_spelling(field: str, value: Any) -> str:
    return f"{field}={value}"


def flag_spelling(field: str, value: Any) -> str:
    return f"--{field.replace('_', '-')} {value}"


class ConfigError(ValueError):
    """A setting refused before the model loads. `field` is the engine field at fault;
    `render(spell)` is the one-line message with settings written by `spell`."""

    def __init__(self, field: str, render: Callable[[Spell], str]) -> None:
        super().__init__(render(python_spelling))
        self.field = field
        self.render = render


def model_context_length(path: str) -> int:
    """The context length of the model at `path` (a resolved .gguf file or HF directory), read
    from its metadata alone: the GGUF header, or config.json through ArchConfig (which caps it
    as the loader does)."""
    if path.endswith(".gguf"):
        from tokenweir.model.gguf_header import context_length

        return context_length(path)
    from tokenweir.model.arch import ArchConfig

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return ArchConfig.from_hf_config(json.load(f)).max_position_embeddings


def resolve_model(config: EngineConfig) -> str:
    """The model's path; ConfigError("model") when there is nothing loadable there."""
    from tokenweir.model.paths import resolve_model_path

    try:
        return resolve_model_path(config.model.model)
    except (FileNotFoundError, ValueError) as exc:
        reason = str(exc)
        raise ConfigError("model", lambda spell: f"{reason}; give {spell('model', 'PATH')} "
                          f"with an existing .gguf file or Hugging Face directory") from None


def check_before_load(config: EngineConfig, context_len: Optional[int] = None) -> int:
    """Resolve the model and check what its context length decides; returns max_model_len.
    `context_len`: the model's, when the caller knows it already (a loaded model)."""
    if context_len is None:
        context_len = model_context_length(resolve_model(config))
    requested = config.model.max_model_len
    if requested is not None and requested > context_len:
        raise ConfigError("max_model_len", lambda spell: (
            f"{spell('max_model_len', requested)} exceeds the model's context length "
            f"{context_len}; give {spell('max_model_len', context_len)} or less"))
    max_model_len = requested or context_len
    check_pool_override(config, max_model_len)
    check_budget(config, max_model_len)
    return max_model_len


def check_pool_override(config: EngineConfig, max_model_len: int) -> None:
    """An explicit pool must hold one max_model_len request besides the null block (block 0,
    never handed out): ceil(max_model_len / block_size) + 1 blocks."""
    blocks = config.cache.num_gpu_blocks_override
    if blocks is None:
        return  # sized from kv_cache_space: needs the model's shape, checked at load
    size = config.cache.block_size
    needed = -(-max_model_len // size)
    if needed + 1 <= blocks:
        return
    fits = (blocks - 1) * size
    raise ConfigError("num_gpu_blocks_override", lambda spell: (
        f"{spell('num_gpu_blocks_override', blocks)} is too small: one "
        f"max_model_len={max_model_len} request needs {needed} blocks of {size} tokens plus "
        f"the null block; give {spell('num_gpu_blocks_override', needed + 1)} or more, or "
        f"{spell('max_model_len', fits)} or less"))


def check_budget(config: EngineConfig, max_model_len: int) -> None:
    """Without chunked prefill one step must hold a whole max_model_len prompt."""
    budget = config.scheduler.max_num_batched_tokens
    if config.scheduler.enable_chunked_prefill or budget >= max_model_len:
        return
    raise ConfigError("max_num_batched_tokens", lambda spell: (
        f"{spell('max_num_batched_tokens', budget)} is less than max_model_len="
        f"{max_model_len} with chunked prefill off (a longer prompt could never be "
        f"scheduled); give {spell('max_num_batched_tokens', max_model_len)} or more, "
        f"{spell('max_model_len', budget)} or less, or turn chunked prefill on"))
