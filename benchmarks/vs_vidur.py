"""tokenweir's simulator vs Vidur (microsoft/vidur), side by side, on one core.

The same workload on both: a fixed trace of prompt and output lengths (lognormal, seeded) with
Poisson arrivals, Llama-2-7B on one H100 per replica, chunked prefill with a 512-token budget,
at most 128 requests per batch, the same KV pool (blocks of 16 tokens), recompute preemption,
no prefix caching; one replica, then a cluster of 16 behind round-robin routing.

- Vidur: its Sarathi replica scheduler (Vidur's chunked-prefill scheduler of the vLLM family:
  its `vllm` scheduler has no chunked prefill) from the checkout `benchmarks/peers/
  setup_vidur.sh` makes, run by `benchmarks/peers/vidur_runner.py` in Vidur's own venv.
  Its step times come from its random-forest predictor trained on the repository's measured
  mlp.csv for Llama-2-7B on H100 and an attention.csv written here (`write_attention_table`):
  the snapshot lacks Vidur's attention tables, so attention is priced by the roofline that
  tokenweir's simulator already uses (tokenweir/sim/hardware.py's h100 profile).
- tokenweir: the real Scheduler with the fcfs policy through `build_simulation` /
  `build_cluster`, its step times from Vidur's own predicted per-op times
  (`VidurOpTimesModel`: the tables Vidur's predictor produced, dumped by the runner), so the
  predictions differ by scheduling and bookkeeping, not by hardware model.

Speed: wall time of the event loop alone (`Simulator.run()` / `Simulation.run()`), each in its
own process pinned to the same core (`--core`), per 1,000 requests, the fastest of `--repeats`
alternating runs per side; set-up (Vidur's predictor training or cache load, tokenweir's
workload) is printed apart. Both record what they record by default (Vidur's metrics store,
with its Chrome trace off; tokenweir's step records and inter-token gaps); `--lean` turns that
off on both sides. Run it under `flock /tmp/cpu.lock` on a shared machine. Prints "Nx faster"
per layout (target >= 5x), and the ratio of CPU times beside it.

    python benchmarks/vs_vidur.py                       # 1,000 requests x 1 replica, 3,200 x 16
    python benchmarks/vs_vidur.py --quick               # 300 x 1, 1,600 x 16, one run each
    python benchmarks/vs_vidur.py --rate 6 --lean       # a lighter load; both sides record less
    python benchmarks/vs_vidur.py --write-attention-table   # only (re)write the peer's table
    VIDUR_PEER=... VIDUR_PYTHON=... python benchmarks/vs_vidur.py   # the peer elsewhere
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenweir.core.sched.policies.base import SchedulingPolicy  # noqa: E402
from tokenweir.sim.build import build_simulation  # noqa: E402
from tokenweir.sim.cluster import build_cluster  # noqa: E402
from tokenweir.sim.hardware import (HardwareProfile, ModelShape, get_hardware,  # noqa: E402
                                    get_shape)
from tokenweir.sim.latency import RooflineLatencyModel, StepTotals  # noqa: E402
from tokenweir.sim.metrics import describe  # noqa: E402
from tokenweir.sim.workload import RequestSpec, synthetic  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "peers" / "vidur_runner.py"
PEER_DIR = Path(os.environ.get("VIDUR_PEER", "/work/peers/vidur"))
PEER_PYTHON = Path(os.environ.get("VIDUR_PYTHON", "/work/peers/vidur-venv/bin/python"))

# The model and device on both sides: Vidur's names, then tokenweir's for the same shape.
VIDUR_MODEL = "meta-llama/Llama-2-7b-hf"
VIDUR_DEVICE, VIDUR_NETWORK = "h100", "h100_pairwise_nvlink"
TOKENWEIR_SHAPE, TOKENWEIR_HARDWARE = "llama-7b", "h100"
CHUNK_SIZE = 512  # token budget per step (Vidur's Sarathi default)
BATCH_SIZE_CAP = 128  # Vidur's default batch_size_cap
BLOCK_SIZE = 16
MAX_TOKENS = 4096  # prompt + output, Vidur's trace cap and prediction range
NUM_BLOCKS = 2048  # KV blocks per replica, both sides (32k tokens: preemption can happen)
PROMPT, OUTPUT = "lognormal:512:0.8", "lognormal:128:0.8"  # tokens, median:sigma
RATE_PER_REPLICA = 12.0  # req/s: busy (~23 requests a step), below saturation


# ---- Vidur's attention table, from tokenweir's roofline -------------------------------------
ATTENTION_COLUMNS = ("n_embd", "n_q_head", "n_kv_head", "block_size",
                     "num_tensor_parallel_workers", "max_model_len", "batch_size",
                     "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend")
TIMED_OPS = ("attn_prefill", "attn_decode", "attn_kv_cache_save")


def attention_ms(shape: ModelShape, hw: HardwareProfile, rows: int, new: int,
                 cached: int) -> tuple[float, float]:
    """(attention, KV save) milliseconds of ONE layer for `rows` requests each computing `new`
    tokens on `cached` ones, by tokenweir's roofline (RooflineLatencyModel's attention term,
    per layer): causal FLOPs 4 * heads * head_dim * q * (c + (q + 1) / 2) against the
    effective FLOP/s, the KV read (c + q tokens) against the effective bandwidth, the larger
    of the two; the KV write of the q new tokens is the save op."""
    flops = 4 * shape.num_heads * shape.head_dim * rows * new * (cached + (new + 1) / 2)
    kv_token_bytes = shape.kv_bytes_per_token(hw.dtype_bytes) / shape.num_layers
    read = rows * (cached + new) * kv_token_bytes
    attention = max(flops / hw.effective_flops, read / hw.effective_bandwidth)
    save = rows * new * kv_token_bytes / hw.effective_bandwidth
    return attention * 1e3, save * 1e3


def attention_grid(max_len: int, max_batch: int) -> list[tuple[int, int, int, bool]]:
    """(prefill_chunk_size, kv_cache_size, batch_size, is_prefill) rows, Vidur's layout:
    chunked prefills at every multiple of the chunk below max_len, whole prefills from 0
    context, decodes over context x batch size. Chunks start at 1 token (Vidur profiles from 64)
    so that the short tails of prompts are priced, not extrapolated."""
    chunks = [q for q in [1, 2, 4, 8, 16, 32, 48] + list(range(64, 1024, 32))
              + list(range(1024, max_len + 1, 128)) if q <= max_len]
    rows = [(q, c, 1, True) for q in chunks for c in range(0, max_len - q + 1, max(q, 64))]
    contexts = [c for c in list(range(32, 1024, 32)) + list(range(1024, max_len + 1, 128))
                if c <= max_len]
    rows += [(0, c, b, False) for c in contexts for b in range(1, max_batch + 1)]
    return rows


def write_attention_table(path: Path, shape_name: str = TOKENWEIR_SHAPE,
                          hardware: str = TOKENWEIR_HARDWARE, max_len: int = MAX_TOKENS,
                          max_batch: int = BATCH_SIZE_CAP) -> int:
    """Vidur's attention.csv schema (what its profiler writes: time_stats.OP.{min,max,mean,
    median,std} in ms per layer, and the shape columns its predictor filters on); returns the
    number of rows."""
    shape, hw = get_shape(shape_name), get_hardware(hardware)
    stats = ("min", "max", "mean", "median", "std")
    header = [f"time_stats.{op}.{s}" for op in TIMED_OPS for s in stats] + list(ATTENTION_COLUMNS)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = attention_grid(max_len, max_batch)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        for chunk, context, batch, is_prefill in rows:
            new = chunk if is_prefill else 1
            attention, save = attention_ms(shape, hw, batch, new, context)
            times = {"attn_prefill": attention if is_prefill else None,
                     "attn_decode": None if is_prefill else attention, "attn_kv_cache_save": save}
            cells = []
            for op in TIMED_OPS:
                t = times[op]
                cells += ["" if t is None else repr(t)] * 4 + ["" if t is None else "0.0"]
            cells += [shape.hidden_size, shape.num_heads, shape.num_kv_heads, BLOCK_SIZE, 1,
                      max_len, batch, chunk, context, is_prefill, "roofline"]
            out.writerow(cells)
    return len(rows)


def attention_table_path(peer: Path = PEER_DIR) -> Path:
    return peer / "data" / "profiling" / "compute" / VIDUR_DEVICE / VIDUR_MODEL / "attention.csv"


# ---- the workload ---------------------------------------------------------------------------
def workload(num_requests: int, rate: float, seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals at `rate` req/s, lognormal prompt and output lengths, prompt + output
    <= MAX_TOKENS (Vidur's trace cap, so it trims nothing)."""
    return synthetic(num_requests, rate, seed=seed, prompt=PROMPT, output=OUTPUT,
                     max_model_len=MAX_TOKENS)


def write_trace_csv(specs: list[RequestSpec], path: Path) -> None:
    """Vidur's trace-replay CSV: arrived_at (s), num_prefill_tokens, num_decode_tokens (the
    output tokens, the first produced by the prefill: tokenweir's output_len)."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for s in specs:
            out.writerow([repr(s.arrival), s.prompt_len, s.output_len])


# ---- running Vidur --------------------------------------------------------------------------
def peer_available(peer: Path = PEER_DIR, python: Path = PEER_PYTHON) -> Optional[str]:
    """None when the peer can run, else why not."""
    if not (peer / "vidur" / "simulator.py").is_file():
        return f"no Vidur checkout at {peer} (benchmarks/peers/setup_vidur.sh)"
    if not python.is_file():
        return f"no Vidur venv python at {python} (benchmarks/peers/setup_vidur.sh)"
    if not attention_table_path(peer).is_file():
        return f"no attention table at {attention_table_path(peer)} (--write-attention-table)"
    return None


def run_vidur(trace: Path, num_replicas: int, workdir: Path, core: Optional[int],
              dump_op_times: bool = False, lean: bool = False, peer: Path = PEER_DIR,
              python: Path = PEER_PYTHON) -> dict:
    """Vidur on `trace` in its own venv and process (pinned to `core` when given); `lean`:
    its metrics store off (write_metrics false; the request records are read either way)."""
    spec = {"trace_file": str(trace), "num_replicas": num_replicas, "chunk_size": CHUNK_SIZE,
            "batch_size_cap": BATCH_SIZE_CAP, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
            "max_tokens": MAX_TOKENS, "model_name": VIDUR_MODEL, "device": VIDUR_DEVICE,
            "network_device": VIDUR_NETWORK, "cache_dir": str(peer / "cache" / "tokenweir"),
            "dump_op_times": dump_op_times, "write_metrics": not lean}
    spec_path, out_path = workdir / f"spec{num_replicas}.json", workdir / f"out{num_replicas}.json"
    spec_path.write_text(json.dumps(spec))
    argv = [str(python), str(RUNNER), str(spec_path), str(out_path)]
    if core is not None:
        argv = ["taskset", "-c", str(core)] + argv
    env = {**os.environ, "PYTHONPATH": str(peer), "WANDB_MODE": "disabled"}
    proc = subprocess.run(argv, cwd=peer, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"Vidur failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


# ---- tokenweir with Vidur's per-op times ----------------------------------------------------
class VidurOpTimesModel(RooflineLatencyModel):
    """A step priced as Vidur's predictor prices a batch, from the per-op times it predicted
    (vidur_runner.op_times, ms per layer): the linear ops at the step's token count rounded up
    to a multiple of 8, the KV save at the exact count, decode attention at (decode rows, their
    mean context rounded up to the granularity), prefill attention at (the prefills' summed
    context rounded up, round(sqrt(sum of chunk squares)) squared), all times the layer count.
    No step overhead: Vidur's CPU-overhead model is off by default.

    Approximations (what StepTotals does not carry): Vidur rounds each prefill's context before
    summing (here the sum is rounded), and counts a request as decoding once its prompt is done
    (here: when it computes one token). A step outside Vidur's prediction grid (summed
    prefill context beyond max_tokens) raises KeyError, as Vidur's own lookup does. The
    roofline base class only carries the shape and hardware that pool sizing would read; the
    pool is given here (num_gpu_blocks_override)."""

    def __init__(self, op_times: dict, shape: str = TOKENWEIR_SHAPE,
                 hardware: str = TOKENWEIR_HARDWARE) -> None:
        super().__init__(get_shape(shape), get_hardware(hardware))
        self.num_layers = op_times["num_layers"]
        self.granularity = op_times["kv_granularity"]
        rounded_ops = [v for k, v in op_times["linear"].items() if k != "attn_kv_cache_save"]
        # per token count n (index n - 1): the ops Vidur prices at the rounded count
        self._linear = [math.fsum(vals) for vals in zip(*rounded_ops)]
        self._kv_save = op_times["linear"]["attn_kv_cache_save"]
        self._decode = {(b, kv): t for b, kv, t in op_times["attn_decode"]}
        self._prefill = {(kv, sq): t for kv, sq, t in op_times["attn_prefill"]}

    def _round_up(self, tokens: int) -> int:
        g = self.granularity
        return (tokens + g - 1) // g * g

    def predict_totals(self, t: StepTotals) -> float:
        if not t.num_tokens:
            return 0.0
        ms = self._linear[(t.num_tokens + 7) // 8 * 8 - 1] + self._kv_save[t.num_tokens - 1]
        decodes = t.num_decode_reqs
        if decodes:  # Vidur's context of a decode counts the token it feeds (c + 1)
            mean_context = (t.decode_context + decodes) // decodes
            ms += self._decode[(decodes, self._round_up(mean_context))]
        if t.num_reqs > decodes:
            context = self._round_up(t.sum_context - t.decode_context)
            chunk = round(math.sqrt(t.sum_q_squared - decodes))
            ms += self._prefill[(context, chunk * chunk)]
        return ms * self.num_layers / 1e3


class WholePromptAdmission(SchedulingPolicy):
    """fcfs, admitting as Vidur's Sarathi scheduler does: a request leaves the queue only if
    its WHOLE prompt (prompt + outputs so far, for a preempted one) fits in the pool above the
    watermark, counting the blocks that requests still mid-prefill will take for the rest of
    their prompts (Sarathi allocates a prompt's blocks at admission; tokenweir, as vLLM,
    allocates a chunk's blocks as the chunk runs). A user policy (policies/base.py), given as
    `vs_vidur:WholePromptAdmission`: tokenweir's scheduler is otherwise unchanged."""

    name = "whole-prompt-admission"

    def begin_step(self, sched, plan):
        self._close_unless_head_fits(sched, plan)
        return None

    def on_scheduled(self, sched, request, plan) -> None:
        if request.num_computed_tokens == 0:  # just admitted (no prefix cache: no hits)
            self._close_unless_head_fits(sched, plan, admitted=request)

    @staticmethod
    def _close_unless_head_fits(sched, plan, admitted=None) -> None:
        """Hold the queue head back this step (after an admission: close admission for the
        step) unless its whole prompt fits above the watermark once every running request
        still prefilling has the blocks for the rest of its prompt."""
        if not sched.waiting:
            return
        kv = sched.kv
        promised = sum(kv.num_new_blocks_needed(r, r.num_tokens) for r in sched.running
                       if r.num_computed_tokens < r.num_tokens - 1)  # still prefilling
        head = sched.waiting.peek()
        free = kv.num_free_blocks - promised - kv.blocks_for_tokens(head.num_tokens)
        if free < int(sched.config.watermark * kv.num_usable_blocks):
            plan.paused.add(head.request_id)
            plan.prefills_closed = admitted is not None


WHOLE_PROMPT = "vs_vidur:WholePromptAdmission"


def engine_args(policy: str = "fcfs") -> dict:
    """tokenweir's scheduler set as Vidur's Sarathi runs: the same budget, batch cap, pool and
    watermark; admission on the prompt's blocks (not prompt + max_tokens), any number of
    requests mid-prefill, recompute preemption, fcfs, no prefix cache."""
    return {"max_num_batched_tokens": CHUNK_SIZE, "max_num_seqs": BATCH_SIZE_CAP,
            "block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS + 1,  # + null block
            "enable_prefix_caching": False, "scheduler_reserve_full_isl": False,
            "max_num_partial_prefills": BATCH_SIZE_CAP, "watermark": 0.01,
            "preemption_mode": "recompute", "scheduling_policy": policy,
            "max_model_len": MAX_TOKENS}


# What `lean` runs leave out on tokenweir's side: the per-step records and the inter-token
# gaps (the request records, all the comparison reads, are kept).
LEAN_RECORDING = {"record_steps": False, "record_itl": False}


def run_tokenweir(specs: list[RequestSpec], num_replicas: int, model,
                  policy: str = "fcfs", lean: bool = False) -> dict:
    """The run's wall and CPU time (the event loop alone) and its request records."""
    setup_started = time.perf_counter()
    recording = LEAN_RECORDING if lean else {}
    if num_replicas == 1:
        sim = build_simulation(engine_args(policy), specs, TOKENWEIR_SHAPE, TOKENWEIR_HARDWARE,
                               latency_model=model, **recording)
    else:
        sim = build_cluster(engine_args(policy), specs, TOKENWEIR_SHAPE, TOKENWEIR_HARDWARE,
                            num_instances=num_replicas, router="round-robin",
                            latency_model=model, **recording)
    setup_seconds = time.perf_counter() - setup_started
    started, cpu_started = time.perf_counter(), time.process_time()
    result = sim.run()
    run_seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    overall = result if num_replicas == 1 else result.overall
    records = [{"arrival": r.arrival, "first_token": r.first_token, "finished": r.finished,
                "num_output": r.num_output, "restarts": r.num_preemptions}
               for r in overall.requests]
    return {"setup_seconds": setup_seconds, "run_seconds": run_seconds,
            "cpu_seconds": cpu_seconds, "end_time": overall.end_time, "requests": records,
            "num_steps": overall.stats.num_steps}


def run_tokenweir_pinned(specs, num_replicas, model, core: Optional[int],
                         lean: bool = False) -> dict:
    """run_tokenweir on `core` (this process's affinity restored after)."""
    if core is None:
        return run_tokenweir(specs, num_replicas, model, lean=lean)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return run_tokenweir(specs, num_replicas, model, lean=lean)
    finally:
        os.sched_setaffinity(0, before)


# ---- comparing ------------------------------------------------------------------------------
@dataclass
class Predictions:
    finished: int
    restarts: int
    makespan: float
    req_per_s: float
    out_tok_per_s: float
    ttft: dict  # mean, p50, p90, p99 in ms
    tpot: dict
    e2e: dict


def predictions(run: dict) -> Predictions:
    """The same metrics from either side's records, by tokenweir's own formulas
    (sim/metrics.py): TTFT = first token - arrival, TPOT = (finish - first token) /
    (outputs - 1), throughput over first arrival .. last event."""
    done = [r for r in run["requests"] if r["finished"] is not None]
    span = run["end_time"] - min(r["arrival"] for r in run["requests"])
    ms = lambda values: {k: v * 1e3 for k, v in describe(values).items()}  # noqa: E731
    return Predictions(
        len(done), sum(r["restarts"] for r in run["requests"]), span, len(done) / span,
        sum(r["num_output"] for r in done) / span,
        ms([r["first_token"] - r["arrival"] for r in done]),
        ms([(r["finished"] - r["first_token"]) / (r["num_output"] - 1)
            for r in done if r["num_output"] > 1]),
        ms([r["finished"] - r["arrival"] for r in done]))


# tokenweir (fcfs, Vidur's op times); Vidur; their ratio; then two untimed tokenweir runs:
# admitting as Sarathi does (WholePromptAdmission, Vidur's op times), and fcfs on tokenweir's
# own roofline (its hardware model instead of Vidur's tables).
PREDICTION_COLUMNS = ("tokenweir", "Vidur", "tw/Vidur", "tw whole-prompt", "tw roofline")


def prediction_rows(tw: Predictions, vd: Predictions, whole: Predictions,
                    own: Predictions) -> list[tuple]:
    """(metric, then one value per PREDICTION_COLUMNS but the ratio)."""
    sides = (tw, vd, whole, own)
    rows = [(name, *(getattr(p, attr) for p in sides))
            for name, attr in (("finished", "finished"), ("preempted/restarted", "restarts"),
                               ("makespan s", "makespan"), ("throughput req/s", "req_per_s"),
                               ("output tok/s", "out_tok_per_s"))]
    for name in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name.upper()} {stat} ms",
                         *(getattr(p, name)[stat] for p in sides)))
    return rows


def format_predictions(rows) -> str:
    lines = ["  {:22s} {:>12s} {:>12s} {:>9s} {:>16s} {:>12s}".format("", *PREDICTION_COLUMNS)]
    for name, a, b, whole, own in rows:
        ratio = a / b if b else math.nan
        lines.append(f"  {name:22s} {a:12,.2f} {b:12,.2f} {ratio:9.3f} {whole:16,.2f} "
                     f"{own:12,.2f}")
    return "\n".join(lines)


def same_timelines(tw: dict, vd: dict, tolerance_s: float = 1e-9) -> int:
    """Requests whose first token and finish agree on both sides within `tolerance_s`."""
    return sum(1 for a, b in zip(tw["requests"], vd["requests"])
               if a["finished"] is not None and b["finished"] is not None
               and abs(a["first_token"] - b["first_token"]) <= tolerance_s
               and abs(a["finished"] - b["finished"]) <= tolerance_s)


def speed_line(label: str, n: int, tw: dict, vd: dict) -> str:
    """Wall time per 1,000 requests each side, the fastest of the repeats; the ratio of wall
    times is the headline, the ratio of CPU times beside it (on a busy machine wall time
    overstates both sides)."""
    tw_k, vd_k = tw["run_seconds"] / n * 1e3, vd["run_seconds"] / n * 1e3
    cpu_ratio = vd["cpu_seconds"] / tw["cpu_seconds"]
    return (f"{label}: {n:,} requests, best of {len(tw.get('samples', [0]))}: tokenweir "
            f"{tw['run_seconds']:.2f} s ({tw_k:.3f} s per 1,000; cpu {tw['cpu_seconds']:.2f} s)"
            f"  Vidur {vd['run_seconds']:.2f} s ({vd_k:.3f} s per 1,000; cpu "
            f"{vd['cpu_seconds']:.2f} s)  ->  {vd_k / tw_k:.1f}x faster (cpu time: "
            f"{cpu_ratio:.1f}x; target >= 5x); tokenweir {tw['num_steps']:,} steps, "
            f"{tw['cpu_seconds'] / tw['num_steps'] * 1e6:.0f} us cpu per step")


def compare(num_requests: int, num_replicas: int, workdir: Path, core: Optional[int],
            op_times: Optional[dict] = None, seed: int = 0,
            rate_per_replica: float = RATE_PER_REPLICA, repeats: int = 1,
            lean: bool = False) -> dict:
    """Both sides on one workload, `repeats` times each, alternating (Vidur first: its op
    times feed tokenweir's model when `op_times` is not given yet). Each side keeps its
    fastest run (`run_seconds` / `cpu_seconds`: the least each measured, the others in
    `samples`); both are deterministic, and each repeat must decide what the first did."""
    specs = workload(num_requests, rate_per_replica * num_replicas, seed)
    trace = workdir / f"trace{num_replicas}.csv"
    write_trace_csv(specs, trace)
    vidur_runs, tw_runs = [], []
    for _ in range(repeats):
        vidur_runs.append(run_vidur(trace, num_replicas, workdir, core,
                                    dump_op_times=op_times is None, lean=lean))
        op_times = op_times or vidur_runs[0].pop("op_times")
        tw_runs.append(run_tokenweir_pinned(specs, num_replicas, VidurOpTimesModel(op_times),
                                            core, lean))
    vidur, tw = fastest(vidur_runs), fastest(tw_runs)
    # not timed: Sarathi's admission rule as a policy plug-in; tokenweir's own hardware model
    whole = run_tokenweir(specs, num_replicas, VidurOpTimesModel(op_times), WHOLE_PROMPT)
    roofline = run_tokenweir(specs, num_replicas, None)
    return {"num_requests": num_requests, "num_replicas": num_replicas, "tokenweir": tw,
            "vidur": vidur, "op_times": op_times, "same_timelines": same_timelines(tw, vidur),
            "same_timelines_whole_prompt": same_timelines(whole, vidur),
            "rows": prediction_rows(*(predictions(r) for r in (tw, vidur, whole, roofline)))}


def fastest(runs: list[dict]) -> dict:
    """The first run's records with the least wall and CPU time over `runs` (which must have
    decided the same: the same request records) and every sample."""
    first = runs[0]
    for other in runs[1:]:
        if other["requests"] != first["requests"]:
            raise RuntimeError("a repeat decided differently from the first run")
    return {**first, "run_seconds": min(r["run_seconds"] for r in runs),
            "cpu_seconds": min(r["cpu_seconds"] for r in runs),
            "samples": [(r["run_seconds"], r["cpu_seconds"]) for r in runs]}


def _summary(result: dict) -> dict:
    """A result without its per-request records and op tables (the figures printed)."""
    timing = ("setup_seconds", "run_seconds", "cpu_seconds", "samples", "num_steps")
    return {"num_requests": result["num_requests"], "num_replicas": result["num_replicas"],
            "same_timelines": result["same_timelines"],
            "same_timelines_whole_prompt": result["same_timelines_whole_prompt"],
            "tokenweir": {k: result["tokenweir"][k] for k in timing},
            "vidur": {k: result["vidur"][k] for k in timing if k in result["vidur"]},
            "columns": ["metric", *(c for c in PREDICTION_COLUMNS if c != "tw/Vidur")],
            "rows": result["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000, help="one replica")
    parser.add_argument("--cluster-requests", type=int, default=3200, help="16 replicas")
    parser.add_argument("--num-replicas", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="300 and 1,600 requests")
    parser.add_argument("--core", type=int, default=0, help="CPU both sides run on (-1: any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per side, alternating; the fastest counts")
    parser.add_argument("--lean", action="store_true",
                        help="both sides record only the request records: Vidur's metrics "
                             "store off, tokenweir without step records and ITLs")
    parser.add_argument("--rate", type=float, default=RATE_PER_REPLICA,
                        help="Poisson arrivals, req/s per replica")
    parser.add_argument("--write-attention-table", action="store_true",
                        help="write the peer's attention.csv and exit")
    parser.add_argument("--json", type=str, default=None, help="write all figures here")
    args = parser.parse_args()
    if args.write_attention_table:
        path = attention_table_path()
        print(f"wrote {write_attention_table(path):,} rows to {path}")
        return 0
    why = peer_available()
    if why:
        print(f"Vidur peer unavailable: {why}")
        return 2
    if args.quick:
        args.num_requests, args.cluster_requests, args.repeats = 300, 1600, 1
    core = None if args.core < 0 else args.core
    results = []
    with tempfile.TemporaryDirectory(prefix="vs_vidur_") as tmp:
        op_times = None
        for n, replicas in ((args.num_requests, 1), (args.cluster_requests, args.num_replicas)):
            r = compare(n, replicas, Path(tmp), core, op_times, args.seed, args.rate,
                        args.repeats, args.lean)
            op_times = r["op_times"]
            results.append(r)
            label = (f"{replicas} replica{'s' if replicas > 1 else ''} at {args.rate:g} req/s "
                     f"each{', lean recording' if args.lean else ''}")
            print(speed_line(label, n, r["tokenweir"], r["vidur"]))
            print(f"  set-up (not timed): tokenweir {r['tokenweir']['setup_seconds']:.2f} s, "
                  f"Vidur {r['vidur']['setup_seconds']:.2f} s (predictor trained once, cached)")
            print(f"  requests with the same first-token and finish times on both sides (1 ns): "
                  f"{r['same_timelines']:,} of {n:,} (admitting whole prompts: "
                  f"{r['same_timelines_whole_prompt']:,})")
            print(format_predictions(r["rows"]))
    if args.json:
        Path(args.json).write_text(json.dumps([_summary(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
