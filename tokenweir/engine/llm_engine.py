"""LLMEngine: input validation, the engine core, and output processing in one synchronous
object. `LLM` (offline) drives it in a loop; the server drives it from a background thread."""

from __future__ import annotations

import atexit
import itertools
import logging
import os
from typing import Any, Iterable, Optional

import torch

from tokenweir.config import EngineConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched import slo
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.engine.engine_core import EngineCore
from tokenweir.engine.input_processor import InputProcessor, PromptType, output_room  # noqa: F401
from tokenweir.malloc_tuning import tune_malloc
from tokenweir.engine.output_processor import OutputProcessor
from tokenweir.engine.preflight import check_before_load
from tokenweir.engine.slo_monitor import SLOMonitor, resolve_ttft_predictor
from tokenweir.guided.engine_hooks import attach_guided_decoder
from tokenweir.model import kernels
from tokenweir.model.attention import kv_cache_bytes_per_block
from tokenweir.model.backends import select_backend
from tokenweir.model.layers import set_batch_invariant, set_quantization
from tokenweir.model.loader import LoadedModel, load_model, preferred_dtype
from tokenweir.outputs import RequestOutput
from tokenweir.request import Request, RequestStatus
from tokenweir.runner.interrupt import CutSignal
from tokenweir.runner.model_runner import ModelRunner

logger = logging.getLogger("tokenweir")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto, cpu, cuda or cuda:N; ValueError naming `device` for anything this host lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={name!r} but CUDA is not available on this host; "
                             f"use device='cpu' or 'auto'")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={name!r} but this host has {count} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 where the hardware runs it fast (CUDA, AVX512-BF16/AMX CPUs), else
    float32 (on an AVX2-only CPU a bfloat16 matmul is ~10x slower than float32)."""
    return preferred_dtype(device) if name == "auto" else _DTYPES[name]


def resolve_max_model_len(requested: Optional[int], model_len: int) -> int:
    if requested is None:
        return model_len
    if requested > model_len:
        raise ValueError(f"max_model_len={requested} exceeds the model's context length "
                         f"{model_len}")
    return requested


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype) -> int:
    """The pool size, null block included: the override, or kv_cache_space GiB worth."""
    if config.cache.num_gpu_blocks_override is not None:
        return config.cache.num_gpu_blocks_override
    per_block = kv_cache_bytes_per_block(loaded.arch, config.cache.block_size, dtype)
    return int(config.cache.kv_cache_space * 2**30) // per_block + 1


def host_memory_bytes() -> int:
    """Memory available on the host now (Linux /proc/meminfo; total memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_swap_blocks(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype,
                    max_model_len: int) -> int:
    """Host blocks for swapped-out KV: swap_space GiB worth, only when swapping can happen.

    The host pool must hold at least one max_model_len request (a smaller one could never take
    a victim whole); a bigger swap_space than host memory allows is refused too."""
    if config.scheduler.preemption_mode == "recompute":
        return 0
    space = int(config.cache.swap_space * 2**30)
    available = host_memory_bytes()
    if space > 0.9 * available:
        raise ValueError(f"swap_space={config.cache.swap_space} GiB exceeds what host memory "
                         f"allows ({available / 2**30:.1f} GiB available); lower swap_space")
    block_size = config.cache.block_size
    per_block = kv_cache_bytes_per_block(loaded.arch, block_size, dtype)
    needed = -(-max_model_len // block_size)
    if space // per_block < needed:
        raise ValueError(
            f"swap_space={config.cache.swap_space} GiB holds {space // per_block} host KV "
            f"block(s) of {per_block / 2**20:.2f} MiB, but swapping out one "
            f"max_model_len={max_model_len} request takes {needed}: raise swap_space to at "
            f"least {needed * per_block / 2**30:.4f} GiB, or use preemption_mode='recompute'")
    return space // per_block


# Start-up warm-up (ModelRunner.warm_up): a dummy prefill and its decode with logits before the
# first real step, so that a server's first request does not pay what any first step pays once
# (the C++ kernels' library loaded, float32 weights packed for them, first-touch memory). On CPU
# it is one request of WARM_UP_CPU_TOKENS tokens, not the whole token budget. Measured on
# SmolLM2-135M float32, AVX2, 2 shared cores (benchmarks/startup.py, contended): the
# full-budget warm-up took 15-17 s of a warm start (5.6 s on a quiet machine), 256 tokens take
# 1.2-1.9 s; without any warm-up a first request of 4 chat prompts took 5.6 s against 1.7 s
# for the same request next, and a first 2048-token step was no slower than the next one
# (10.0 vs 12.4 s, noise): the one-time costs are what the first request needs warmed.
# 64 tokens, not 256, since the packed weights come from the load cache (model/packed_cache.py):
# warm `tokenweir generate` to its first token, exclusive lock, load 1.9 (benchmarks/startup.py
# --cache-dir, 2 runs each): 256 tokens 0.63-0.89 s of warm-up, ready - import 1.69-1.96 s;
# 64 tokens 0.23-0.25 s, 1.37-1.39 s; no warm-up 1.14-1.19 s (serve: 1.29-1.40 s of warm-up at
# 256 tokens; /health 3.97-4.45 s without any).
# Not at all on CPU when the packed weights are mapped from the load cache (unless
# TOKENWEIR_WARMUP=1): then `tokenweir serve` (which builds the engine while its main thread
# imports the server) paid 0.9-1.2 s of warm-up for nothing measurable. benchmarks/startup.py
# --first-request 420, warm serve, exclusive lock, 4 interleaved pairs: ready 4.64 4.71 4.29
# 4.19 s with it, 3.80 4.08 3.66 4.12 s without; the first 420-token request (max_tokens 1)
# 1.58 1.20 1.28 1.28 s with, 1.18 1.28 1.42 1.46 s without (mean 1.34 both); a 20-token one
# 0.12-0.18 s either way.
# On CUDA, where it costs milliseconds, it stays one step of the whole budget in requests of
# 256 tokens (at most WARM_UP_MAX_SEQS), as vLLM's profile run. TOKENWEIR_WARMUP=0 skips it (the
# test suite does: it builds hundreds of engines).
WARM_UP_CPU_TOKENS = 64
WARM_UP_MAX_SEQS = 64


def warm_up_shape(config: EngineConfig, device: torch.device) -> tuple[int, int, int]:
    """(tokens, requests, tokens per request) of the start-up warm-up on `device`."""
    budget = config.scheduler.max_num_batched_tokens
    if device.type == "cpu":
        tokens = min(budget, WARM_UP_CPU_TOKENS)
        return tokens, 1, tokens
    return budget, config.scheduler.max_num_seqs or WARM_UP_MAX_SEQS, 256


def check_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """quantization runs where it pays (tokenweir/model/layers.py, int8_matmul): CPU,
    bfloat16, one process (TP workers load their own unquantized weights)."""
    if config.model.quantization is None:
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"quantization={config.model.quantization!r} needs dtype bfloat16 "
                         f"(got {str(dtype).removeprefix('torch.')}: in float32 it measured "
                         f"slower than the unquantized kernels)")
    if device.type != "cpu":
        raise ValueError(f"quantization={config.model.quantization!r} runs on CPU only "
                         f"(device is {device.type})")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"quantization={config.model.quantization!r} runs in one process: "
                         "tensor_parallel_size must be 1")


# CUDA runs batch-invariant mode on Triton kernels (backends/triton_matmul.py; the triton
# attention backend's fixed tiles, triton_paged.plan_step) that only Triton's interpreter has
# run so far (tests/model/test_triton_batch_invariant.py; its `cuda` tests are for a GPU): until
# a GPU session has run those, the mode asks for this opt-in there.
BATCH_INVARIANT_CUDA_ENV = "TOKENWEIR_BATCH_INVARIANT_CUDA"


def check_batch_invariant(config: EngineConfig, device: torch.device) -> None:
    """--batch-invariant runs where every op has a batch-invariant form (model/layers.py,
    invariant_matmul; model/attention.py, fixed-order items): one process, no int8 (whose
    kernel applies by row count), and on CPU the C++ kernels and the CPU attention path, on
    CUDA (opted in, see above) the triton attention backend. Refused otherwise, with the
    reason, before the weights load."""
    if not config.model.batch_invariant:
        return
    why = None
    if device.type not in ("cpu", "cuda"):
        why = f"it runs on CPU or CUDA (device is {device.type})"
    elif config.parallel.tensor_parallel_size > 1:
        why = "it runs in one process: tensor_parallel_size must be 1"
    elif config.model.quantization is not None:
        why = f"quantization={config.model.quantization!r} picks its kernel by row count"
    elif device.type == "cuda":
        why = _cuda_refusal(device)
    elif select_backend(device) is not None:
        why = "it needs the cpu attention backend (unset TOKENWEIR_ATTENTION_BACKEND)"
    elif kernels.paged_attention_kernel() is None or kernels.packed_linear_kernel() is None:
        why = "it needs the C++ CPU kernels (unavailable here, or TOKENWEIR_CPU_KERNELS=0)"
    if why is not None:
        raise ValueError(f"batch_invariant: {why}")


def _cuda_refusal(device: torch.device) -> Optional[str]:
    if os.environ.get(BATCH_INVARIANT_CUDA_ENV) != "1":
        return (f"on CUDA its Triton kernels have run only in Triton's interpreter so far: "
                f"set {BATCH_INVARIANT_CUDA_ENV}=1 to use them (the `cuda` tests of "
                f"tests/model/test_triton_batch_invariant.py check them on a GPU)")
    backend = select_backend(device)
    if getattr(backend, "name", None) != "triton":
        return "on CUDA it needs the triton attention backend (triton installed)"
    return None


def warm_up_enabled() -> bool:
    return os.environ.get("TOKENWEIR_WARMUP", "1") != "0"


def warms_up(device: torch.device, cpu_warm_up: Optional[bool],
             prepacked: bool = False) -> bool:
    """Whether an engine on `device` runs the start-up warm-up (LLMEngine's `cpu_warm_up`;
    else TOKENWEIR_WARMUP=0 never, =1 always). Unset on CPU: only when the weights still need
    packing, i.e. not `prepacked` (mapped packed from the load cache), see WARM_UP_CPU_TOKENS."""
    if device.type == "cpu" and cpu_warm_up is not None:
        return cpu_warm_up
    if device.type == "cpu" and prepacked and "TOKENWEIR_WARMUP" not in os.environ:
        return False
    return warm_up_enabled()


def needs_measured_costs(config: EngineConfig) -> bool:
    return (config.scheduler.preemption_mode == "auto"
            or config.scheduler.victim_policy == "cost")


class LLMEngine(InputProcessor):
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None,
                 cpu_warm_up: Optional[bool] = None, defer_tokenizer: bool = False) -> None:
        """`loaded` lets callers (tests, sweeps) share one set of weights between engines;
        it must match the config's model, dtype and device. `cpu_warm_up`: on CPU, whether to
        run the start-up warm-up (see WARM_UP_CPU_TOKENS); None follows TOKENWEIR_WARMUP
        (unset: on unless the packed weights were mapped from the load cache). On CUDA the warm-up (milliseconds, and the decode graphs' capture)
        always follows TOKENWEIR_WARMUP. `defer_tokenizer`: a tokenizer from the load cache
        is built at its first use (model/deferred_tokenizer.py): for the engine core process,
        which leaves tokenizing to the API process."""
        config.validate()
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        # refused before the weights load: a bad setting costs milliseconds, not a load
        check_before_load(config, None if loaded is None else loaded.max_model_len)
        check_quantization(config, self.device, self.dtype)
        check_batch_invariant(config, self.device)
        if self.device.type == "cpu":
            tune_malloc()  # activations reused, not faulted in again each step: see the module
        if loaded is None:
            loaded = load_model(config.model.model, self.dtype, self.device,
                                pack=config.parallel.tensor_parallel_size == 1,  # else: sharded
                                defer_tokenizer=defer_tokenizer)
        set_quantization(loaded.model, config.model.quantization)
        set_batch_invariant(loaded.model, config.model.batch_invariant)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.arch.vocab_size
        self.max_model_len = resolve_max_model_len(config.model.max_model_len,
                                                   loaded.max_model_len)
        num_blocks = num_kv_blocks(config, loaded, self.dtype)
        num_host_blocks = num_swap_blocks(config, loaded, self.dtype, self.max_model_len)
        kv = KVCacheManager(num_blocks, config.cache.block_size,
                            enable_prefix_caching=config.cache.enable_prefix_caching,
                            num_host_blocks=num_host_blocks)
        scheduler = Scheduler(config.scheduler, kv, self.max_model_len)  # refuses a tiny pool
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        warm_up = warms_up(self.device, cpu_warm_up, prepacked=bool(loaded.packed_cache))
        runner = self._make_runner(config, loaded, num_blocks, num_host_blocks, warm_up)
        if needs_measured_costs(config):
            scheduler.costs = runner.measure_preemption_costs()
            logger.info("measured preemption costs: %s", scheduler.costs)
        self.guided = attach_guided_decoder(runner, self.tokenizer, self.vocab_size)
        self.core = EngineCore(scheduler, runner)
        self.slo_monitor: Optional[SLOMonitor] = None
        if scheduler.policy.deadline_aware:
            self._start_slo(config, scheduler, runner, loaded.arch.num_layers)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.tracer = None  # the step tracer (timeline/tracer.py), when something records
        self._trace_meta = self._run_settings(config, loaded, num_blocks)
        if config.model.step_trace:
            self.start_trace(config.model.step_trace)
        logger.info("tokenweir engine: model=%s dtype=%s device=%s max_model_len=%d "
                    "kv blocks=%d x %d tokens", self.model_name, self.dtype, self.device,
                    self.max_model_len, num_blocks, config.cache.block_size)

    def _make_runner(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int,
                     num_host_blocks: int, warm_up: bool):
        """The executor of the steps: tensor-parallel ranks, or one ModelRunner warmed up
        (and, on CUDA, its decode graphs captured) before the first request when `warm_up`."""
        tp_size = config.parallel.tensor_parallel_size
        if tp_size > 1:  # this process is rank 0; workers load the model from its path
            from tokenweir.parallel.executor import TPExecutor
            return TPExecutor(loaded.model, loaded.path, tp_size, num_blocks,
                              config.cache.block_size, self.dtype, self.device,
                              self.eos_token_ids, config.model.seed,
                              num_host_blocks=num_host_blocks,
                              timeout_s=config.parallel.distributed_timeout)
        runner = ModelRunner(loaded.model, loaded.arch, num_blocks, config.cache.block_size,
                             self.dtype, self.device, self.eos_token_ids, config.model.seed,
                             num_host_blocks=num_host_blocks)
        if warm_up:
            runner.warm_up(*warm_up_shape(config, self.device))
            runner.capture_decode_graphs(config.scheduler.max_num_seqs or WARM_UP_MAX_SEQS)
        return runner

    def _start_slo(self, config: EngineConfig, scheduler: Scheduler, runner,
                   num_layers: int) -> None:
        """A deadline-aware policy: its TTFT predictor, and (mid-step cuts on) the cut signal
        the runner obeys plus the monitor thread that writes it."""
        policy = scheduler.policy
        policy.ttft_predictor = resolve_ttft_predictor(config.scheduler, runner.measure_ttft_line)
        logger.info("slo TTFT predictor: %s", policy.ttft_predictor)
        if config.scheduler.slo_mid_step_cut:
            signal = CutSignal(num_layers, config.scheduler.slo_cut_layer_fraction)
            runner.cut_signal = signal
            self.slo_monitor = SLOMonitor(policy, signal, self.core.pending_arrivals,
                                          self.core.clock, wake=self.core.arrival_event).start()
            self.core.schedule_listeners.append(self.slo_monitor.step_scheduled)

    def _run_settings(self, config: EngineConfig, loaded: LoadedModel,
                      num_blocks: int) -> dict[str, Any]:
        """A trace's meta line: what `tokenweir calibrate --from-trace` needs for a profile."""
        per_block = kv_cache_bytes_per_block(loaded.arch, config.cache.block_size, self.dtype)
        sched = config.scheduler
        return {"label": f"engine ({sched.scheduling_policy})", "model": self.model_name,
                "path": str(loaded.path), "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "threads": torch.get_num_threads(),
                "block_size": config.cache.block_size,
                "kv_bytes_per_token": per_block // config.cache.block_size,
                "max_model_len": self.max_model_len, "num_layers": loaded.arch.num_layers,
                "num_gpu_blocks": num_blocks,
                "max_num_batched_tokens": sched.max_num_batched_tokens}

    def start_trace(self, path: str) -> None:
        """Record every step from now on to `path` (step-record JSON lines; the Chrome form
        next to it when the engine closes, or at exit). `--trace FILE` starts it at once."""
        from tokenweir.timeline.tracer import JsonlSink

        self.add_trace_sink(JsonlSink(path, self._trace_meta))
        atexit.register(self.tracer.close)

    def add_trace_sink(self, sink) -> None:
        """Hand every step record to `sink` (a JsonlSink, a live server's StepRing)."""
        from tokenweir.timeline.tracer import attach_tracer

        self.tracer = attach_tracer(self.core, sink)

    def submit_request(self, request: Request, prompt: Optional[str]) -> None:
        """Like add_request, but safe to call from another thread while step() runs."""
        self.outputs.add_request(request, prompt)
        self.core.submit(request)

    def shutdown(self) -> None:
        """Stop the SLO monitor thread (if any) and the tensor-parallel workers (if any); the
        engine is not usable afterwards."""
        if self.slo_monitor is not None:
            self.slo_monitor.stop()
        self.close()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def ttft_infeasible(self, request: Request) -> bool:
        """`request` has a TTFT target that the deadline-aware policy's TTFT predictor says it
        cannot meet even alone (core/sched/slo.py: infeasible_alone); False for a policy that
        predicts no TTFTs or a request without a target."""
        policy = self.scheduler.policy
        if not policy.deadline_aware or request.ttft_slo_ms is None:
            return False
        return slo.infeasible_alone(policy.ttft_predictor, request.num_prompt_tokens,
                                    request.ttft_slo_ms / 1000,
                                    self.config.scheduler.slo_hopeless_tolerance)

    def add_request(self, request: Request, prompt: Optional[str]) -> None:
        self.core.add_request(request)
        self.outputs.add_request(request, prompt)

    def abort_requests(self, request_ids: Iterable[str],
                       delta: bool = False) -> list[RequestOutput]:
        """Abort requests by output id (a parallel-sampling request: all its samples). Returns
        the final output (finish reason "abort") of each one still in flight, in the order
        named; their state is forgotten (no later step returns them)."""
        request_ids = list(request_ids)
        self.core.abort_requests(self._sample_ids(request_ids))
        finals = (self.outputs.abort(request_id, delta=delta) for request_id in request_ids)
        return [final for final in finals if final is not None]

    def _sample_ids(self, request_ids: list[str]) -> list[str]:
        """The scheduler's ids behind these output ids (a group's: its samples')."""
        ids: list[str] = []
        for request_id in request_ids:
            group = self.outputs.groups.get(request_id)
            ids += [s.request_id for s in group.group.samples] if group else [request_id]
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- step -------------------------------------------------------------------------
    def step(self, delta: bool = False, final_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got tokens
        (`final_only`: only for those that finished, and for parallel-sampling groups; what
        offline generate uses: the rest costs host time per request per step. A lone request
        without stop strings or logprobs is then not even detokenised until it finishes or a
        later step or abort shows it: OutputProcessor.defer).

        Finished requests' state is released after their final output is returned. A request
        whose output processing fails (detokenization, stop strings, building the output)
        finishes alone, with finish reason "error" and the message in `RequestOutput.error`;
        so does one that failed inside the engine core (see engine_core.py).
        """
        decoded: Optional[list[str]] = [] if final_only else None  # plain decodes, by id
        core_outputs = self.core.step(decoded)
        now = self.core.clock()
        made = self.outputs.fold_step(core_outputs, now, delta=delta,
                                      on_stop=self._finish_stopped, on_fail=self._fail_now,
                                      final_only=final_only)
        if decoded:  # their text waits (OutputProcessor.defer)
            self.outputs.defer(decoded, now)
        if self.tracer is not None:
            self.tracer.output_processed(self.core.clock())
        return list(made.values())

    def _finish_stopped(self, request: Request) -> None:
        """A stop string ended `request`: finish it in the scheduler now (blocks freed)."""
        self.core.abort_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _fail_now(self, request_ids: list[str], message: str) -> None:
        """Output processing failed: fail these requests in the scheduler now."""
        self.core.fail_requests({request_id: message for request_id in request_ids})

    def get_metrics(self):
        return self.core.metrics.snapshot(self.scheduler)

    def close(self) -> None:
        """Release executor resources (tensor-parallel worker processes); idempotent."""
        if self.tracer is not None:
            self.tracer.close()
            atexit.unregister(self.tracer.close)
        close = getattr(self.core.executor, "close", None)
        if close is not None:
            close()
        if self.guided is not None:
            self.guided.close()
