"""Frozen configuration dataclasses.

Every field's `help` metadata doubles as CLI help: `tokenweir.cli` generates `--flag-name`
options from these classes, so a new field is a new flag with no hand-written mirror.
Field names follow vLLM's engine arguments wherever vLLM has one.

The engine configs (model, cache, scheduler, parallel) come first; after them, one config per
group of command-line flags (generate, serve, bench serve, simulate, sweep, study, calibrate).
Field metadata the flag generator reads (tokenweir/cli/flags.py), all optional but `help`:
  help        the flag's help text; "(default: X)" is appended unless it already says one
  choices     the only values accepted (a hard restriction; a plain `str` field without
              `choices` accepts any text and leaves checking to `validate()`)
  choices_from  "module:NAME": the accepted values are the keys of that dict (or that tuple),
              read when the parser is built (the simulator's shape/hardware/router tables)
  flag        the option's spelling when it is not `--field-name`; aliases: more spellings
  positional  an optional positional argument instead of an option
  switch      a bool that is a bare `--flag` setting True (not `--flag/--no-flag`)
  repeat      the flag may be given many times, each adding one value (a tuple field)
  nargs       "*": one flag followed by any number of values (a tuple field)
  parse       a function text -> value used instead of the field type (ValueError: bad text)
  metavar, required   as in argparse
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
SLO_GATES = ("conservative", "aggressive")
SLO_STEP_PREDICTORS = ("auto", "ttft_line")
PREEMPTION_POLICIES = ("fcfs", "priority", "cost")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)  # ModelConfig.quantization (tokenweir/model/layers.py)
OUTPUT_THREAD_MODES = ("auto", "on", "off")  # ServeConfig.output_thread

# The model every command and `LLM()` use when none is named: an alias model/loader.py resolves.
DEFAULT_MODEL = "smollm2-135m"
# The server's request-body limit (`tokenweir serve --max-request-body-bytes`): 4 MiB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


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
    model: str = _f(DEFAULT_MODEL, "model: alias, Hugging Face directory or .gguf file")
    dtype: str = _f("auto", "weights and KV dtype; auto = bfloat16 where the hardware runs it fast, else float32", choices=DTYPES)
    max_model_len: Optional[int] = _f(
        None, "longest prompt + output, in tokens (default: the model's context length)")
    device: str = _f("auto", "cpu, cuda, or auto (cuda when available)")
    quantization: Optional[str] = _f(
        None, "weight-only quantization of decode matmuls: int8 (CPU, bfloat16, one process: "
        "batches of up to 4 rows read int8 weights, per output channel; the rest stay "
        "unquantized)",
        choices=QUANTIZATIONS)
    seed: int = _f(0, "seed for requests that do not set their own")
    batch_invariant: bool = _f(
        False, "batch-invariant kernels: a request's tokens and logprobs are the same "
        "bits whatever shares its step, however its prompt is chunked, cached or recomputed "
        "(matmuls and attention reduce each row in one fixed order; slower). CPU: the C++ "
        "kernels; CUDA: Triton kernels, opt-in with TOKENWEIR_BATCH_INVARIANT_CUDA=1 until "
        "checked on a GPU")
    step_trace: Optional[str] = _f(
        None, "write every engine step (its requests, prefill and decode tokens, phase times, "
        "preemptions, swaps, cuts, KV usage) to FILE as step-record JSON lines, and "
        "FILE.chrome.json for Perfetto when the engine closes (default: off)",
        flag="--trace", metavar="FILE")

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, "
                             f"got {self.quantization!r}")


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


_POLICY_CLASS = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _is_policy_name(name: str, builtins: tuple[str, ...]) -> bool:
    """A built-in policy name, or `package.module:Class` (imported when the scheduler is
    built, core/sched/policies/__init__.py)."""
    return name in builtins or bool(_POLICY_CLASS.match(name))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = _f(2048, "token budget of one step")
    max_num_seqs: int = _f(256, "most requests running at once (0 = unlimited)")
    enable_chunked_prefill: bool = _f(
        True, "split prompts across steps; off: a prompt that does not fit the budget waits")
    long_prefill_token_threshold: int = _f(
        0, "most tokens one request may prefill in a step (0 = only the budget caps it)")
    max_num_partial_prefills: int = _f(
        1, "most requests left mid-prefill (chunked) when a step ends")
    scheduling_policy: str = _f(
        "fcfs", "waiting-queue order, preempt gate and admission veto: fcfs, priority, slo, or "
        "a policy class of your own as package.module:Class (core/sched/policies/base.py)")
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
        None, "victim choice: fcfs, priority, cost (least work lost), or a victim policy class "
        "of your own as package.module:Class; default: the scheduling policy's (fcfs for slo)")
    max_preemptions: int = _f(
        3, "under the cost policy, a request preempted this many times becomes immune")
    slo_preempt_gate: str = _f(
        "conservative", "slo policy: preempt a running prefill for a waiter more urgent than "
        "the most urgent (conservative) or the least urgent (aggressive) one", choices=SLO_GATES)
    slo_margin_ms: float = _f(
        10.0, "slo policy: how much less slack (ms) the waiter must have than the reference")
    slo_max_preemptions: int = _f(
        3, "slo policy: a request paused or cut this many times becomes immune")
    slo_max_pauses: Optional[int] = _f(
        None, "slo policy: a separate cap for pauses between steps (they waste no work): a "
        "request paused this many times is not paused again, and only cuts count against "
        "slo_max_preemptions; default: pauses and cuts count together")
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
    slo_tpot_ms: Optional[float] = _f(
        None, "slo policy: TPOT target (mean ms per output token after the first) of requests "
        "that carry none; each step's prefill chunk is capped so that running decodes stay "
        "on their TPOT target")
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
    slo_step_predictor: str = _f(
        "auto", "slo policy: how long the step in flight will take (for the gate and the "
        "monitor's cuts): ttft_line, the TTFT predictor's line over the step's tokens (what "
        "the real engine uses), or auto (the line on the engine; in the simulator its latency "
        "model, i.e. the true step time: set ttft_line to simulate the engine faithfully)",
        choices=SLO_STEP_PREDICTORS)

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
        if not _is_policy_name(self.scheduling_policy, SCHEDULING_POLICIES):
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES} or "
                             f"'package.module:Class', got {self.scheduling_policy!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if self.preemption_policy is not None and \
                not _is_policy_name(self.preemption_policy, PREEMPTION_POLICIES):
            raise ValueError(f"preemption_policy must be one of {PREEMPTION_POLICIES} or "
                             f"'package.module:Class', got {self.preemption_policy!r}")
        if self.max_preemptions < 1:
            raise ValueError(f"max_preemptions must be >= 1, got {self.max_preemptions}")
        self._validate_slo()

    def _validate_slo(self) -> None:
        if self.slo_preempt_gate not in SLO_GATES:
            raise ValueError(f"slo_preempt_gate must be one of {SLO_GATES}, "
                             f"got {self.slo_preempt_gate!r}")
        if self.slo_step_predictor not in SLO_STEP_PREDICTORS:
            raise ValueError(f"slo_step_predictor must be one of {SLO_STEP_PREDICTORS}, "
                             f"got {self.slo_step_predictor!r}")
        if self.slo_tpot_ms is not None and self.slo_tpot_ms <= 0:
            raise ValueError(f"slo_tpot_ms must be positive, got {self.slo_tpot_ms}")
        if self.slo_margin_ms < 0:
            raise ValueError(f"slo_margin_ms must be >= 0, got {self.slo_margin_ms}")
        if not 0 <= self.slo_hopeless_tolerance < 1:
            raise ValueError(f"slo_hopeless_tolerance must be in [0, 1), "
                             f"got {self.slo_hopeless_tolerance}")
        if self.slo_max_pauses is not None and self.slo_max_pauses < 0:
            raise ValueError(f"slo_max_pauses must be >= 0, got {self.slo_max_pauses}")
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
ENGINE_FIELD_NAMES = frozenset(f.name for c in CONFIG_CLASSES for f in dataclasses.fields(c))


def engine_kwargs(args: Any) -> dict[str, Any]:
    """The engine fields set on `args` (a parsed command line). The command line leaves an
    engine flag the user did not give unset, so these are exactly the flags given; every other
    field keeps its dataclass default when `EngineConfig.from_kwargs` builds the config."""
    return {k: v for k, v in vars(args).items() if k in ENGINE_FIELD_NAMES}


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


# ---- command-line configs: one class per group of flags (tokenweir/cli generates them) ----
def int_list(text: str) -> list[int]:
    """"256,1024" -> [256, 1024] (a flag value listing integers)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class GenerateConfig:
    """what to ask and how to sample (`tokenweir generate`)"""
    prompt: Optional[tuple[str, ...]] = _f(
        None, "a prompt (repeatable) (default: four built-in questions)", repeat=True)
    no_chat: bool = _f(False, "send prompts raw, no chat template", switch=True)
    max_tokens: int = _f(64, "most tokens generated per prompt")
    temperature: float = _f(0.0, "sampling temperature (0: greedy)")
    top_p: float = _f(1.0, "nucleus sampling: keep the likeliest tokens up to this probability")
    top_k: int = _f(0, "sample among the k likeliest tokens (0: no limit)")
    summary: bool = _f(False, "print the engine summary", switch=True)


@dataclass(frozen=True)
class ServeConfig:
    """the HTTP server (`tokenweir serve`)"""
    model_tag: Optional[str] = _f(
        None, "model (alias, HF directory or .gguf); same as --model", positional=True)
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    api_key: Optional[str] = _f(
        None, "require `Authorization: Bearer KEY` on /v1/* (default: $TOKENWEIR_API_KEY)")
    served_model_name: Optional[tuple[str, ...]] = _f(
        None, "name(s) clients use for the model (default: the model argument)", repeat=True)
    max_waiting_requests: Optional[int] = _f(
        None, "answer 503 + Retry-After while this many requests wait (default: no limit)")
    drain_timeout: float = _f(30.0, "seconds to let running requests finish on SIGTERM")
    slo_reject_hopeless: bool = _f(
        False, "with --scheduling-policy slo: answer 503 + Retry-After to a request whose "
        "ttft_slo_ms the TTFT predictor says it cannot meet even with the server idle",
        switch=True)
    max_request_body_bytes: int = _f(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        "largest request body accepted, in bytes; a larger one is answered 413 before it is "
        "read in full")
    timeline_steps: int = _f(
        2000, "the most recent steps GET /timeline shows (the schedule page; behind the API "
        "key, which a browser passes as ?key=...); 0 turns the page and its recording off")
    profile_serving: bool = _f(
        False, "time where a served token goes (schedule, forward, update, output processing, "
        "event loop, SSE writing): GET /profile answers it as JSON, and the table is printed "
        "at shutdown", switch=True)
    output_thread: str = _f(
        "auto", "process outputs (detokenization, stop strings) on a thread of their own: on; "
        "off (on the engine thread, between steps); auto: on only where a core is left beside "
        "torch's threads (on a 2-core machine the thread's work stalls the forward's OpenMP "
        "team)", choices=OUTPUT_THREAD_MODES)
    engine_process: bool = _f(
        True, "run the engine core (scheduler, KV cache, model) in a process of its own beside "
        "the API process (HTTP, tokenizer, detokenization, metrics), as vLLM v1 does: the "
        "server imports and starts in parallel with the model's load (not with "
        "--profile-serving, which times the in-process path)")
    log_level: str = _f("info", "log level of the server and of uvicorn")
    data_parallel_size: int = _f(
        1, "replicas of the engine, each a process of its own with a share of the cores (one "
        "torch thread each on 2 cores), behind `tokenweir router` on --host/--port")
    routing_policy: str = _f(
        "prefix-aware", "with --data-parallel-size > 1: which replica serves a request "
        "(tokenweir router --routing-policy)")


# tokenweir/routing's built-in names (kept here: config imports no package of tokenweir)
ROUTING_POLICY_NAMES = ("round-robin", "least-loaded", "prefix-aware", "session-affinity")
_ROUTING_HELP = ("which replica serves a request: round-robin, least-loaded, prefix-aware, "
                 "session-affinity (by the request's `user` or an X-Session-Id header), or a "
                 "policy class of your own as package.module:Class (tokenweir/routing/base.py)")


@dataclass(frozen=True)
class RouterConfig:
    """the router in front of `tokenweir serve` replicas (`tokenweir router`)"""
    replicas: Optional[tuple[str, ...]] = _f(
        None, "base URL of a replica, e.g. http://127.0.0.1:8001 (repeatable)", flag="--replica",
        repeat=True, required=True, metavar="URL")
    routing_policy: str = _f("prefix-aware", _ROUTING_HELP)
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    api_key: Optional[str] = _f(
        None, "require `Authorization: Bearer KEY` on /v1/* (default: $TOKENWEIR_API_KEY); "
        "the router passes it on to the replicas")
    max_request_body_bytes: int = _f(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        "largest request body accepted, in bytes; a larger one is answered 413 before it is "
        "read in full")
    health_interval: float = _f(1.0, "seconds between health checks of each replica")
    health_timeout: float = _f(
        3.0, "seconds a replica has to answer a health check; a replica that fails one is taken "
        "out (its in-flight requests end) until one succeeds")
    routing_block_bytes: int = _f(
        64, "prefix-aware routing hashes the prompt text in blocks of this many bytes")
    log_level: str = _f("info", "log level of the router and of uvicorn")

    def __post_init__(self) -> None:
        if not _is_policy_name(self.routing_policy, ROUTING_POLICY_NAMES):
            raise ValueError(f"unknown routing policy {self.routing_policy!r}: use one of "
                             f"{', '.join(ROUTING_POLICY_NAMES)} or package.module:Class")
        for name in ("health_interval", "health_timeout", "routing_block_bytes",
                     "max_request_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class BenchServeConfig:
    """the load generator (`tokenweir bench serve`), against any OpenAI-compatible server"""
    base_url: Optional[str] = _f(None, "e.g. http://127.0.0.1:8000", required=True)
    model: Optional[str] = _f(None, "model name sent with every request", required=True)
    endpoint: str = _f("/v1/completions", "API path; one containing 'chat' sends messages")
    api_key: Optional[str] = _f(None, "sent as `Authorization: Bearer KEY`")
    num_prompts: int = _f(100, "requests to send")
    dataset: Optional[str] = _f(None, "JSONL with a 'prompt' field per line")
    input_len: int = _f(128, "prompt length in tokens (random token ids; no --dataset)")
    output_len: int = _f(64, "tokens asked of every request (max_tokens, EOS ignored)")
    length_dist: str = _f("fixed", "how --input-len/--output-len vary",
                          choices=("fixed", "uniform", "lognormal"))
    range_ratio: float = _f(0.5, "uniform: lengths in len*(1±ratio); lognormal: sigma")
    vocab_size: int = _f(30000, "random prompt token ids are drawn below this")
    request_rate: float = _f(float("inf"), "requests/s (inf: all at once)")
    burstiness: float = _f(1.0, "gamma shape: 1 = Poisson, < 1 burstier")
    max_concurrency: Optional[int] = _f(None, "most requests in flight (default: no limit)")
    seed: int = _f(0, "seed of the workload and the arrivals")
    percentiles: str = _f("50,90,99", "percentiles reported, comma-separated")
    goodput: tuple[str, ...] = _f((), "SLOs like ttft:500 tpot:50 (ms)", nargs="*")
    save_result: Optional[str] = _f(None, "write the result JSON here")
    timeout: float = _f(600.0, "seconds one request may take")
    no_progress: bool = _f(False, "no progress bar", switch=True)


@dataclass(frozen=True)
class SimTargetConfig:
    """what the simulator models: a model shape on a hardware profile (roofline step times)"""
    model_shape: str = _f("llama-7b", "model shape the roofline prices: built in, or a "
                          "shipped config (tokenweir/sim/models)",
                          choices_from="tokenweir.sim.model_config:MODEL_TABLE")
    model_name: Optional[str] = _f(
        None, "a shipped model config by name (same names as --model-shape; replaces it)",
        flag="--model", choices_from="tokenweir.sim.model_config:MODEL_TABLE")
    model_config: Optional[str] = _f(
        None, "a Hugging Face config.json (or a directory holding one) to price instead of "
        "--model-shape: Llama, Mistral, Qwen2/3 and their MoE relatives (Mixtral, Qwen-MoE)",
        metavar="PATH")
    hardware: str = _f("h100", "hardware profile the roofline prices",
                       choices_from="tokenweir.sim.hardware:HARDWARE_PROFILES")
    hardware_dtype: Optional[str] = _f(
        None, "weights and KV in this dtype on --hardware: its peak FLOP/s and bytes per "
        "element (default: the profile's own, bf16 on GPUs)",
        choices=("fp4", "fp8", "int8", "bf16", "fp16", "tf32", "fp32"))
    tp: int = _f(1, "tensor-parallel degree", flag="--tensor-parallel-size", aliases=("--tp",))


@dataclass(frozen=True)
class SimulationConfig(SimTargetConfig):
    """simulation: step times and the workload (`tokenweir simulate` and `tokenweir sweep`)"""
    profile: Optional[str] = _f(
        None, "step times from a fitted profile (tokenweir calibrate) instead of the roofline "
        "of --model-shape/--hardware (every instance of a cluster)", metavar="PATH")
    num_requests: int = _f(1000, "requests in the synthetic workload")
    request_rate: float = _f(math.inf, "requests/s (inf: all at 0)")
    arrival: str = _f("poisson", "inter-arrival distribution", choices=("poisson", "gamma"))
    cv: float = _f(1.0, "gamma inter-arrival coefficient of variation")
    prompt_len: str = _f("lognormal:256:0.8", "fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    output_len: str = _f("lognormal:128:0.8", "output tokens, in the forms of --prompt-len")
    num_prefix_groups: int = _f(0, "groups of requests sharing a prompt prefix (0: none)")
    prefix_len: int = _f(0, "tokens shared within a group")
    priority_mix: Optional[str] = _f(None, "PRIO:WEIGHT,... e.g. 0:0.8,1:0.2")
    trace: Optional[str] = _f(
        None, "JSONL workload (arrival, prompt_len, output_len, priority, ttft_slo_ms, "
        "prefix_group); replaces the synthetic one")
    save_trace: Optional[str] = _f(None, "write the workload as JSONL here")
    ttft_slo_ms: Optional[float] = _f(None, "TTFT target for goodput and attainment, ms")
    tpot_slo_ms: Optional[float] = _f(None, "TPOT target for goodput and attainment, ms")


@dataclass(frozen=True)
class SimulateConfig(SimulationConfig):
    """one simulation and where its results go (`tokenweir simulate`)"""
    chrome_trace: Optional[str] = _f(
        None, "write a Chrome/Perfetto trace JSON here (cluster runs: one process per instance)")
    json_out: Optional[str] = _f(None, "write the metrics as JSON here", flag="--json")
    step_records: Optional[str] = _f(
        None, "write the run's step records (JSONL) here, for `tokenweir timeline` (one "
        "instance)", metavar="PATH")
    samples: int = _f(
        1, "simulations, each a draw of the machine the --profile measured (its "
        "\"variability\", from calibrate --from-trace: run-to-run speed and step jitter); "
        "the report is each metric's mean over them, with their spread (1: the profile's "
        "deterministic model)", metavar="N")


@dataclass(frozen=True)
class ClusterConfig:
    """cluster (any of these runs the cluster simulator)"""
    num_instances: int = _f(1, "instances behind the router")
    router: str = _f(
        "round-robin", "how requests are spread over instances: round-robin, least-loaded, "
        "prefix-aware, session-affinity (a session's turns stay where its first went), or a "
        "policy class of your own as package.module:Class (tokenweir/routing/base.py)")
    pp_size: int = _f(1, "pipeline stages per instance: at most this many batches in flight")
    pd: Optional[str] = _f(
        None, "prefill/decode disaggregation: P prefill and D decode instances "
        "(replaces --num-instances)", metavar="P:D")
    link_gbps: float = _f(100.0, "KV-transfer link into each decode instance, Gbit/s")
    sessions: int = _f(
        0, "multi-turn agentic sessions (replace the synthetic requests; they start at "
        "--request-rate, first prompt --prompt-len, outputs --output-len)")
    turns: str = _f("fixed:4", "turns per session (length distribution)")
    turn_prompt_len: str = _f("fixed:64", "new user tokens in each later turn")
    tool_delay_ms: str = _f(
        "fixed:500", "tool-call delay before each later turn, ms (length distribution)")


@dataclass(frozen=True)
class SweepConfig(SimulationConfig):
    """a grid of engine-config values, simulated in parallel (`tokenweir sweep`)"""
    sets: Optional[tuple[str, ...]] = _f(
        None, "config field and values (repeatable: grid)", flag="--set", repeat=True,
        required=True, metavar="FIELD=V1,V2,...")
    out: str = _f("sweep.csv", "CSV path (a PNG goes beside it when matplotlib is installed)")
    jobs: int = _f(0, "processes (0: one per CPU)")
    ray: Optional[str] = _f(
        None, "run each point as a Ray task: on a local Ray started for the run (--ray alone) "
        "or on the cluster at ADDRESS; a failing point is reported and the others kept "
        "(needs pip install 'tokenweir[ray]')", nargs="?", const="local", metavar="ADDRESS")


@dataclass(frozen=True)
class StudyConfig(SimTargetConfig):
    """a canned simulator study (`tokenweir study ...`): CSV + PNG + table"""
    out_dir: str = _f("study-out", "CSV and PNG go here")
    seed: int = _f(0, "seed of the study's workload")
    jobs: int = _f(0, "processes (0: one per CPU)")
    ray: Optional[str] = _f(
        None, "run each point as a Ray task: on a local Ray started for the run (--ray alone) "
        "or on the cluster at ADDRESS; a failing point is reported and the others kept "
        "(needs pip install 'tokenweir[ray]')", nargs="?", const="local", metavar="ADDRESS")


@dataclass(frozen=True)
class FrontierStudyConfig(StudyConfig):
    """frontier: one long prompt arrives among steady decodes; one point per chunk size"""
    long_prompt: int = _f(30000, "tokens of the long prompt")
    num_decodes: int = _f(32, "steady decoding requests")
    decode_prompt: int = _f(256, "prompt tokens of each decoding request")
    decode_output: int = _f(1024, "output tokens of each decoding request")
    long_arrival: float = _f(0.2, "when the long prompt arrives, seconds")
    chunks: tuple[int, ...] = _f((256, 512, 1024, 2048, 4096, 8192, 16384),
                                 "chunk sizes (max_num_batched_tokens), comma-separated",
                                 parse=int_list)


@dataclass(frozen=True)
class LoadStudyConfig(StudyConfig):
    """a study over a synthetic workload"""
    prompt_len: str = _f("lognormal:512:0.5", "fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    output_len: str = _f("lognormal:256:0.5", "output tokens, in the forms of --prompt-len")


@dataclass(frozen=True)
class PoolStudyConfig(LoadStudyConfig):
    """pool: steps and preemptions vs KV pool size"""
    num_requests: int = _f(200, "requests in the workload")
    request_rate: float = _f(math.inf, "requests/s (inf: all at 0)")
    blocks: Optional[tuple[int, ...]] = _f(
        None, "pool sizes (default: 10 sizes from the smallest that fits one request to room "
        "for the whole workload)", parse=int_list)


@dataclass(frozen=True)
class PoliciesStudyConfig(LoadStudyConfig):
    """policies: victim policies x preemption modes under memory pressure"""
    num_requests: int = _f(300, "requests in the workload")
    request_rate: float = _f(8.0, "requests/s (inf: all at 0)")
    blocks: Optional[int] = _f(
        None, "pool size (default: 1/16 of what the whole workload needs at once)")
    priority_mix: str = _f("0:0.3,1:0.7", "PRIO:WEIGHT,... e.g. 0:0.8,1:0.2")


@dataclass(frozen=True)
class CalibrateConfig:
    """timing the real runner for a simulator profile (`tokenweir calibrate`)"""
    model: str = _f(DEFAULT_MODEL, "alias, HF directory or .gguf file", positional=True)
    out: str = _f("step_profile.json", "profile JSON path")
    quick: bool = _f(False, "the 9-point grid (smoke tests)", switch=True)
    repeats: int = _f(5, "timings per point (median)")
    threads: int = _f(1, "torch threads while timing (0: torch's default); the engine being "
                      "modelled must run with the same number")
    dtype: str = _f("float32", "dtype of the timed model", choices=DTYPES)
    device: str = _f("cpu", "device of the timed model")
    block_size: int = _f(16, "tokens per KV cache block")
    from_trace: Optional[tuple[str, ...]] = _f(
        None, "fit to the steps of these real-engine traces (`--trace FILE` of generate, "
        "serve, LLM) instead of timing the grid; the model argument is then ignored "
        "(default: time the grid)", metavar="TRACE")
    holdout_every: int = _f(5, "with --from-trace: every N-th step is held out of the fit "
                            "and the fit's error on them reported (0: none)")


# The timeline page's limits (tokenweir/timeline/layout.py): more requests are dropped (latest
# arrivals first), more steps aggregated into buckets; the page says which.
TIMELINE_MAX_ROWS = 5000
TIMELINE_MAX_COLUMNS = 100_000


@dataclass(frozen=True)
class TimelineConfig:
    """the schedule as one self-contained HTML page (`tokenweir timeline`)"""
    traces: tuple[str, ...] = _f(
        (), "one or two traces (step-record JSONL or a simulator --chrome-trace); two are "
        "shown side by side, rows aligned by request id", positional=True, nargs="+",
        metavar="TRACE")
    output: str = _f("timeline.html", "the page to write", aliases=("-o",))
    title: Optional[str] = _f(None, "page title (default: the traces' names)")
    pid: Optional[int] = _f(
        None, "chrome trace of a cluster: the instance's process id (default: the first)")
    max_rows: int = _f(TIMELINE_MAX_ROWS, "requests shown; later arrivals are dropped (the "
                       "page says so)")
    max_columns: int = _f(TIMELINE_MAX_COLUMNS, "columns; more steps are aggregated into "
                          "buckets (the page says so)")
    write_records: Optional[str] = _f(
        None, "also write the (first) trace as step records, e.g. to convert a chrome trace "
        "(default: no)", metavar="JSONL")
    write_chrome: Optional[str] = _f(
        None, "also write the traces as ONE Chrome/Perfetto JSON, a process each: a real "
        "run (--trace) and its simulation side by side in ui.perfetto.dev (default: no)",
        metavar="JSON")
