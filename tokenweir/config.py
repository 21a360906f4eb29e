"""Frozen configuration dataclasses.

Every field's `help` metadata doubles as CLI help: `tokenweir.cli` generates `--flag-name`
options from these classes, so a new field is a new flag with no hand-written mirror.
Field names follow vLLM's engine arguments wherever vLLM has one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
SLO_GATES = ("conservative", "aggressive")
PREEMPTION_POLICIES = ("fcfs", "priority", "cost")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


_SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_field_types(config: Any) -> None:
    """Every field annotated int / float / bool / str (or Optional of one) holds that type,
    and every number is finite; ValueError naming the field otherwise. An int is accepted
    where a float is expected; a bool is never a number. Other annotations are not checked."""
    for f in dataclasses.fields(config):
        annotation = str(f.type).replace(" ", "")
        optional = annotation.startswith("Optional[")
        kind = _SCALAR_TYPES.get(annotation[len("Optional["):-1] if optional else annotation)
        value = getattr(config, f.name)
        if kind is None or (optional and value is None):
            continue
        accepted = (int, float) if kind is float else kind
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{f.name} must be {_TYPE_WORDS[kind]}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f("smollm2-135m", "model: alias, Hugging Face directory or .gguf file")
    dtype: str = _f("auto", "weights and KV dtype; auto = bfloat16 where the hardware runs it fast, else float32", choices=DTYPES)
    max_model_len: Optional[int] = _f(
        None, "longest prompt + output, in tokens (default: the model's context length)")
    device: str = _f("auto", "cpu, cuda, or auto (cuda when available)")
    seed: int = _f(0, "seed for requests that do not set their own")

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "tokens per KV cache block")
    num_gpu_blocks_override: Optional[int] = _f(
        None, "number of KV blocks in the pool, null block included (overrides kv_cache_space)")
    kv_cache_space: float = _f(1.0, "GiB of memory for the KV pool when not overridden")
    enable_prefix_caching: bool = _f(True, "reuse the KV of identical leading full blocks")
    swap_space: float = _f(
        4.0, "GiB of host memory for swapped-out KV (used by preemption_mode swap / auto)")

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2 (block 0 is the null block), "
                f"got {self.num_gpu_blocks_override}")
        if self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be positive, got {self.kv_cache_space}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = _f(2048, "token budget of one step")
    max_num_seqs: int = _f(256, "most requests running at once (0 = unlimited)")
    enable_chunked_prefill: bool = _f(
        True, "split prompts across steps; off: a prompt that does not fit the budget waits")
    long_prefill_token_threshold: int = _f(
        0, "most tokens one request may prefill in a step (0 = only the budget caps it)")
    max_num_partial_prefills: int = _f(1, "most requests mid-prefill (chunked) at once")
    scheduling_policy: str = _f("fcfs", "waiting-queue order and victim choice",
                                choices=SCHEDULING_POLICIES)
    watermark: float = _f(
        0.01, "fraction of KV blocks new admissions may not take while requests run")
    scheduler_reserve_full_isl: bool = _f(
        True, "admit only if prompt + max_tokens (capped at max_model_len) fits the free pool")
    prioritize_prefill: bool = _f(
        False, "schedule prefills first, then decodes fill what is left of the budget")
    preemption_mode: str = _f(
        "recompute", "what a victim loses: recompute (drop its KV), swap (copy it to host), "
        "or auto (the cheaper, by measured rates)", choices=PREEMPTION_MODES)
    preemption_policy: Optional[str] = _f(
        None, "victim choice: fcfs, priority, or cost (least work lost); default: the "
        "scheduling policy", choices=PREEMPTION_POLICIES)
    max_preemptions: int = _f(
        3, "under the cost policy, a request preempted this many times becomes immune")
    slo_preempt_gate: str = _f(
        "conservative", "slo policy: preempt a running prefill for a waiter more urgent than "
        "the most urgent (conservative) or the least urgent (aggressive) one", choices=SLO_GATES)
    slo_margin_ms: float = _f(
        10.0, "slo policy: how much less slack (ms) the waiter must have than the reference")
    slo_max_preemptions: int = _f(
        1, "slo policy: a request paused or cut this many times becomes immune")
    slo_mid_step_cut: bool = _f(
        True, "slo policy: a monitor thread may cut a running step at an attention-layer "
        "boundary (off: only between steps)")
    slo_cut_layer_fraction: float = _f(
        0.9, "slo policy: a forward pass past this fraction of its layers refuses to be cut")
    slo_hopeless_tolerance: float = _f(
        0.0, "slo policy: a request counts as hopeless (sinks in the EDF order, never "
        "preempts) only if it would miss its deadline even running this fraction faster "
        "than its predicted TTFT; 0: the sign of the slack")
    slo_isolate_at_risk_prefill: bool = _f(
        True, "slo policy: a prefill with less slack than the larger of its predicted TTFT and "
        "one token budget's prefill runs with decodes only (no other prefill's chunk lengthens "
        "its step)")
    slo_ttft_a_ms_per_token: Optional[float] = _f(
        None, "slo policy: TTFT predictor slope, ms per uncached prompt token "
        "(default: the profile, else measured at start-up)")
    slo_ttft_b_us_per_token2: float = _f(
        0.0, "slo policy: TTFT predictor quadratic term, us per uncached prompt token squared "
        "(attention makes a long prompt's TTFT convex; 0 keeps the line a * n + c)")
    slo_ttft_c_ms: Optional[float] = _f(
        None, "slo policy: TTFT predictor intercept in ms (default: the profile, else measured)")
    slo_ttft_profile: Optional[str] = _f(
        None, "slo policy: JSON profile (tokenweir calibrate) holding the TTFT predictor")

    def validate(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs must be >= 0 (0 = unlimited), got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills < 1:
            raise ValueError(
                f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if self.preemption_policy not in (None, *PREEMPTION_POLICIES):
            raise ValueError(f"preemption_policy must be one of {PREEMPTION_POLICIES}, "
                             f"got {self.preemption_policy!r}")
        if self.max_preemptions < 1:
            raise ValueError(f"max_preemptions must be >= 1, got {self.max_preemptions}")
        self._validate_slo()

    def _validate_slo(self) -> None:
        if self.slo_preempt_gate not in SLO_GATES:
            raise ValueError(f"slo_preempt_gate must be one of {SLO_GATES}, "
                             f"got {self.slo_preempt_gate!r}")
        if self.slo_margin_ms < 0:
            raise ValueError(f"slo_margin_ms must be >= 0, got {self.slo_margin_ms}")
        if not 0 <= self.slo_hopeless_tolerance < 1:
            raise ValueError(f"slo_hopeless_tolerance must be in [0, 1), "
                             f"got {self.slo_hopeless_tolerance}")
        if self.slo_max_preemptions < 0:
            raise ValueError(f"slo_max_preemptions must be >= 0, got {self.slo_max_preemptions}")
        if not 0 <= self.slo_cut_layer_fraction <= 1:
            raise ValueError(f"slo_cut_layer_fraction must be in [0, 1], "
                             f"got {self.slo_cut_layer_fraction}")
        for name in ("slo_ttft_a_ms_per_token", "slo_ttft_b_us_per_token2", "slo_ttft_c_ms"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def victim_policy(self) -> str:
        return self.preemption_policy or self.scheduling_policy


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _f(
        1, "ranks the model is sharded over (heads, KV heads, MLP); > 1 starts worker "
        "processes (torch.distributed: gloo on CPU, NCCL on CUDA)")
    distributed_timeout: float = _f(
        60.0, "seconds a tensor-parallel collective or worker answer may take before the "
        "group is declared failed")

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout <= 0:
            raise ValueError(
                f"distributed_timeout must be positive, got {self.distributed_timeout}")


CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Route flat vLLM-style keyword arguments to the config they belong to.

        Unknown names raise TypeError, as a mistyped keyword argument would.
        """
        parts: dict[type, dict[str, Any]] = {c: {} for c in CONFIG_CLASSES}
        owner = {f.name: c for c in CONFIG_CLASSES for f in dataclasses.fields(c)}
        for name, value in kwargs.items():
            if name not in owner:
                raise TypeError(f"unknown engine argument {name!r}")
            parts[owner[name]][name] = value
        config = cls(model=ModelConfig(**parts[ModelConfig]),
                     cache=CacheConfig(**parts[CacheConfig]),
                     scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                     parallel=ParallelConfig(**parts[ParallelConfig]))
        config.validate()
        return config

    def validate(self) -> None:
        for part in (self.model, self.cache, self.scheduler, self.parallel):
            check_field_types(part)  # types and NaN first: the range checks compare numbers
            part.validate()
