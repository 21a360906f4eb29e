"""Deadline-aware scheduling on the real engine: chunked FCFS vs slo, urgent TTFT attainment.

The mixed workload of benchmarks/slo_goodput.py scaled to this machine (prompt and output
lengths times --scale, the token budget too): 80% chat prompts, 20% documents, Poisson
arrivals; a quarter of the requests urgent (TTFT target 1.5x their solo TTFT), the rest
generous (5x); every request's TPOT target --tpot-x times the solo decode step. Solo TTFTs are
measured first on this machine, through the engine (median of --solo-repeats probes at four
prompt lengths), and again before every seed's pair of runs (--reprobe, on by default: a shared
machine's speed drifts 2-3x over minutes, and targets set from an earlier probe turn too lax or
too strict); the slo policy's TTFT predictor is fitted to the probes' chunk steps and given to
both sides. The load is the rate as a multiple of 1 / (mean solo service time).

Per load and seed, fcfs and slo run on the same requests back to back (the order alternating
by seed, so that a machine drifting over minutes drifts under both); each run is traced. Per
policy and load: urgent TTFT attainment (pooled over seeds), generous attainment, throughput
(prompt + output tokens over first arrival to last finish). Per load: the urgent gain in
points with two 95% intervals, a paired bootstrap over the urgent requests (resampled within
each seed; both policies see the same requests) and a t-interval over the per-seed gains
(2 degrees of freedom at 3 seeds: wide), and the throughput ratio slo/fcfs (t-interval over
seeds).

Beside each real figure, the simulator's prediction for the same runs: a profile fitted
(`calibrate_from_traces`, as benchmarks/sim_fidelity.py does) to --calibration-runs separate
traced runs on this machine (their own seeds, never a run it predicts), then each real run
simulated at the arrival offsets that run saw, with the same engine configuration and TTFT
predictor (the step in flight predicted by the TTFT line on both sides), --sim-samples draws
of the machine each.

The operating points (loads 1.0 and 1.5, 48 requests per run: about 12 urgent) were picked in
the simulator first (--plan, on a calibration saved by --save-calibration): there chunked fcfs
meets 57% (load 1.0) and 37% (1.5) of urgent targets, urgent chat requests stuck behind
document prefills, and slo's gain is +39 and +43 points with throughput within 3%; at 24-32
requests per run the queues stay short and the gain's interval reaches zero, at load 2.0 slo's
cuts cost 4% of throughput.

    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py            # ~16 minutes, 1 idle core
    # the same in three parts (a calibration, then one load each; the real runs' arrival
    # spans, 45-77 s each, are the cost: the simulations take ~10 s in all):
    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py --seeds 0 --save-calibration C.json
    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py --loads 1.5 --load-calibration C.json
    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py --loads 1.0 --load-calibration C.json
    # (~1.5, ~6.5 and ~9 minutes on this 2-core EPYC)
    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py --plan C.json --loads 1 1.5 2 3 \
        --plan-requests 24 32 48 --seeds 5 --sim-samples 4      # the simulator alone: ~3 min
    PYTHONPATH=. .venv/bin/python benchmarks/slo_real.py --quick --model DIR   # seconds (a test)

On a machine shared with other jobs keep --threads 1 (two torch threads stall whenever anything
else runs: sim_fidelity.py) and read the printed stall counts and load averages.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._workload import FIRST_TEXT_TOKEN_ID  # noqa: E402
from benchmarks.slo_attainment import (fit_ttft_from_chunks, interpolate,  # noqa: E402
                                       measure_decode_seconds, measure_solo_ttfts)
from benchmarks.slo_goodput import (GENEROUS, OUTPUT_RANGE, URGENT, WORKLOADS,  # noqa: E402
                                    Item, Mix, make_items as make_mix_items, mean_interval)
from tokenweir.config import SchedulerConfig  # noqa: E402
from tokenweir.sim.workload import RequestSpec  # noqa: E402

POLICIES = ("fcfs", "slo")
# The unscaled mixed workload of slo_goodput.py (its outputs: OUTPUT_RANGE) and its budget.
MIX = WORKLOADS["mixed"].classes
BUDGET = 2048
BOOTSTRAP_RESAMPLES = 2000


# ---- the workload -----------------------------------------------------------------------------
def scaled(lo_hi: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(lo_hi[0] * scale)), max(2, round(lo_hi[1] * scale))


def make_items(n: int, seed: int, scale: float, solo: Callable[[int], float]) -> list[Item]:
    """n requests of the mixed workload, lengths scaled: slo_goodput's make_items (the same draws)
    on the scaled classes and outputs; no per-item TPOT (Setup.tpot_ms is the engine's)."""
    mix = Mix("mixed", tuple((share, scaled(lo_hi, scale)) for share, lo_hi in MIX))
    return make_mix_items(mix, n, seed, solo, None, scaled(OUTPUT_RANGE, scale))


def mean_service_seconds(scale: float, solo: Callable[[int], float], decode_s: float) -> float:
    """A request's mean solo service time: its solo TTFT plus its decode steps."""
    prefill = 0.0
    for share, lo_hi in MIX:
        lo, hi = scaled(lo_hi, scale)
        prefill += share * statistics.fmean(solo(n) for n in range(lo, hi + 1,
                                                                   max(1, (hi - lo) // 16)))
    return prefill + decode_s * statistics.fmean(scaled(OUTPUT_RANGE, scale))


def prompts_for(items: list[Item], seed: int, vocab_size: int) -> list[list[int]]:
    """Random text-token prompts (no two share a prefix: no prefix-cache hits)."""
    rng = random.Random(f"prompts-{seed}")
    low = min(FIRST_TEXT_TOKEN_ID, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(it.prompt_len)] for it in items]


# ---- the engine's configuration (both sides) ---------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What the real runs and their simulations share."""

    budget: int
    max_model_len: int
    blocks: int
    ttft_abc: tuple[float, float, float]  # seconds, seconds / token^2, seconds
    tpot_ms: float
    slo_extra: dict = field(default_factory=dict)

    def scheduler_kwargs(self, policy: str) -> dict:
        a, b, c = self.ttft_abc
        kwargs = dict(scheduling_policy=policy, max_num_batched_tokens=self.budget,
                      max_model_len=self.max_model_len,
                      num_gpu_blocks_override=self.blocks, slo_tpot_ms=self.tpot_ms,
                      slo_ttft_a_ms_per_token=a * 1e3, slo_ttft_b_us_per_token2=b * 1e6,
                      slo_ttft_c_ms=c * 1e3, slo_step_predictor="ttft_line")
        return dict(kwargs, **self.slo_extra) if policy == "slo" else kwargs


# ---- one real run -----------------------------------------------------------------------------
@dataclass
class Run:
    """One run's per-request outcomes (in item order) and counts."""

    policy: str
    load: float
    seed: int
    arrivals: list[float]  # seconds after the first arrival, as the engine saw them
    ttft_met: list[bool]
    urgent: list[bool]
    tokens: int
    span_s: float
    unfinished: int = 0
    cuts: int = 0
    pauses: int = 0
    memory_preemptions: int = 0
    stalls: int = 0
    loadavg: float = 0.0

    def attainment(self, urgent: bool) -> tuple[int, int]:
        pairs = [m for m, u in zip(self.ttft_met, self.urgent) if u == urgent]
        return sum(pairs), len(pairs)

    @property
    def throughput(self) -> float:
        return self.tokens / self.span_s if self.span_s > 0 else 0.0


def serve(engine, items: list[Item], prompts: list[list[int]], rate: float,
          drain_s: float) -> list:
    """Submit `items` from a feeder thread at their arrival times (rate `rate`) while this
    thread steps the engine; stops `drain_s` after the last arrival. Returns the requests
    (None for one never submitted)."""
    from tokenweir.request import SamplingParams

    requests: list = [None] * len(items)

    def feed() -> None:
        start = time.monotonic()
        for it, prompt in zip(items, prompts):
            delay = start + it.unit_arrival / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            params = SamplingParams(temperature=0.0, max_tokens=it.output_len, ignore_eos=True)
            request, _ = engine.make_request(prompt, params, request_id=f"r{it.index}",
                                             priority=URGENT if it.urgent else GENEROUS,
                                             ttft_slo_ms=it.ttft_s * 1000)
            requests[it.index] = request
            engine.submit_request(request, None)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    stop_at = time.monotonic() + items[-1].unit_arrival / rate + drain_s
    finished = 0
    while finished < len(items) and time.monotonic() < stop_at:
        if engine.has_unfinished_requests():
            finished += sum(1 for out in engine.step() if out.finished)
        else:
            time.sleep(0.0005)
    feeder.join()
    return requests


def run_real(loaded, model: str, setup: Setup, policy: str, load: float, seed: int,
             items: list[Item], rate: float, args, trace_path: Path) -> Run:
    from benchmarks.sim_fidelity import _warm_up, stalled_steps
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model=model, dtype="float32", device="cpu",
                                      **setup.scheduler_kwargs(policy))
    engine = LLMEngine(config, loaded=loaded)
    try:
        _warm_up(engine, [min(FIRST_TEXT_TOKEN_ID, loaded.arch.vocab_size // 2) + i
                          for i in range(32)])
        engine.start_trace(str(trace_path))
        requests = serve(engine, items, prompts_for(items, seed, loaded.arch.vocab_size),
                         rate, args.drain_seconds)
        stats = engine.scheduler.stats
    finally:
        engine.shutdown()
    return make_run(policy, load, seed, items, requests, stats,
                    len(stalled_steps(trace_path)))


def make_run(policy, load, seed, items, requests, stats, stalls: int) -> Run:
    first = min(r.arrival_time for r in requests if r is not None)
    ends = [r.finished_time for r in requests if r is not None and r.finished_time]
    met = [r is not None and r.first_token_time is not None
           and r.first_token_time - r.arrival_time <= it.ttft_s + 1e-9
           for it, r in zip(items, requests)]
    tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in requests if r is not None)
    by_cause = stats.preemptions_by_cause
    return Run(policy, load, seed,
               [(r.arrival_time - first) if r is not None else math.nan for r in requests],
               met, [it.urgent for it in items], tokens, max(ends, default=first) - first,
               sum(1 for r in requests if r is None or r.finished_time is None),
               by_cause["slo-mid-step"], by_cause["slo-between-steps"], by_cause["memory"],
               stalls, os.getloadavg()[0])


# ---- the simulator's prediction ----------------------------------------------------------------
def simulate(profile: dict, setup: Setup, run: Run, items: list[Item],
             samples: int) -> list[Run]:
    """The simulator on `run`'s workload at the arrival offsets it saw: one Run per draw of
    the machine the profile was fitted on."""
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.latency import sample_machines

    specs = [RequestSpec(f"r{it.index}", run.arrivals[it.index], it.prompt_len, it.output_len,
                         priority=URGENT if it.urgent else GENEROUS,
                         ttft_slo_ms=it.ttft_s * 1000, index=it.index) for it in items]
    out = []
    for machine in sample_machines(profile, samples, seed=run.seed):
        sim = build_simulation(setup.scheduler_kwargs(run.policy), specs,
                               latency_model=machine, record_itl=False)
        result = sim.run()
        by_id = {r.request_id: r for r in result.requests}
        records = [by_id[f"r{it.index}"] for it in items]
        met = [r.first_token is not None and r.first_token - r.arrival <= it.ttft_s + 1e-9
               for it, r in zip(items, records)]
        tokens = sum(it.prompt_len + r.num_output for it, r in zip(items, records))
        span = max(r.finished for r in records if r.finished is not None) - \
            min(r.arrival for r in records)
        by_cause = sim.scheduler.stats.preemptions_by_cause
        out.append(Run(run.policy, run.load, run.seed, run.arrivals, met, run.urgent, tokens,
                       span, sum(r.finished is None for r in records),
                       by_cause["slo-mid-step"], by_cause["slo-between-steps"],
                       by_cause["memory"]))
    return out


# ---- statistics -------------------------------------------------------------------------------
def paired_bootstrap_gain(pairs_by_seed: list[list[tuple[bool, bool]]], resamples: int,
                          seed: int = 0) -> tuple[float, float, float]:
    """(gain, low, high) in points: the pooled attainment of the second of each pair minus the
    first's, and its 95% percentile interval over `resamples` resamplings of the pairs within
    each seed (a request's two outcomes stay together)."""
    def gain(groups) -> float:
        n = sum(len(g) for g in groups)
        return 100.0 * sum(b - a for g in groups for a, b in g) / max(1, n)

    rng = random.Random(seed)
    draws = sorted(gain([[g[rng.randrange(len(g))] for _ in g] for g in pairs_by_seed if g])
                   for _ in range(resamples))
    return gain(pairs_by_seed), draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def urgent_pairs(fcfs: Run, slo: Run) -> list[tuple[bool, bool]]:
    return [(a, b) for a, b, u in zip(fcfs.ttft_met, slo.ttft_met, fcfs.urgent) if u]


def pooled(runs: list[Run], urgent: bool) -> float:
    met = sum(r.attainment(urgent)[0] for r in runs)
    total = sum(r.attainment(urgent)[1] for r in runs)
    return 100.0 * met / max(1, total)


@dataclass
class Comparison:
    """One load: the real runs per policy and seed, and each one's simulated draws."""

    load: float
    real: dict = field(default_factory=dict)  # policy -> [Run per seed]
    sim: dict = field(default_factory=dict)  # policy -> [[Run per draw] per seed]

    def summary(self) -> dict:
        out: dict = {"load": self.load, "policies": {}}
        for policy, runs in self.real.items():
            draws = [d for per_seed in self.sim.get(policy, []) for d in per_seed]
            out["policies"][policy] = {
                "urgent_pct": pooled(runs, True), "generous_pct": pooled(runs, False),
                "throughput": [r.throughput for r in runs],
                "cuts": sum(r.cuts for r in runs), "pauses": sum(r.pauses for r in runs),
                "unfinished": sum(r.unfinished for r in runs),
                "stalls": sum(r.stalls for r in runs),
                "sim_urgent_pct": pooled(draws, True) if draws else None,
                "sim_generous_pct": pooled(draws, False) if draws else None,
                "sim_cuts": (sum(d.cuts for d in draws) / len(draws) * len(runs)
                             if draws else None)}
        if set(POLICIES) <= set(self.real):
            out["vs_fcfs"] = self._versus()
        return out

    def _versus(self) -> dict:
        fcfs, slo = self.real["fcfs"], self.real["slo"]
        gain, low, high = paired_bootstrap_gain(
            [urgent_pairs(f, s) for f, s in zip(fcfs, slo)], BOOTSTRAP_RESAMPLES)
        per_seed = [pooled([s], True) - pooled([f], True) for f, s in zip(fcfs, slo)]
        ratios = [s.throughput / f.throughput for f, s in zip(fcfs, slo)]
        out = {"urgent_gain_points": gain, "bootstrap_95": (low, high),
               "per_seed_gain": per_seed, "t_95": mean_interval(per_seed),
               "throughput_ratios": ratios, "throughput_ratio": mean_interval(ratios)}
        if self.sim.get("fcfs") and self.sim.get("slo"):
            sim_gains = [pooled(s, True) - pooled(f, True)
                         for f, s in zip(self.sim["fcfs"], self.sim["slo"])]
            sim_ratios = [statistics.fmean(d.throughput for d in s)
                          / statistics.fmean(d.throughput for d in f)
                          for f, s in zip(self.sim["fcfs"], self.sim["slo"])]
            out["sim_gain"] = mean_interval(sim_gains)
            out["sim_throughput_ratio"] = mean_interval(sim_ratios)
        return out


# ---- report -----------------------------------------------------------------------------------
def format_comparison(summary: dict, seeds: int) -> str:
    lines = [f"== load {summary['load']:.2f} ({seeds} seed(s) per policy; real | simulated) =="]
    lines.append(f"{'policy':<7}{'urgent%':>9}{'sim':>7}{'generous%':>11}{'sim':>7}"
                 f"{'tok/s (per seed)':>26}{'cuts':>6}{'sim':>6}{'pauses':>8}{'unfin':>7}"
                 f"{'stalls':>8}")
    for policy, p in summary["policies"].items():
        sim_u = "-" if p["sim_urgent_pct"] is None else f"{p['sim_urgent_pct']:.1f}"
        sim_g = "-" if p["sim_generous_pct"] is None else f"{p['sim_generous_pct']:.1f}"
        sim_c = "-" if p["sim_cuts"] is None else f"{p['sim_cuts']:.1f}"
        tps = " ".join(f"{t:.0f}" for t in p["throughput"])
        lines.append(f"{policy:<7}{p['urgent_pct']:>9.1f}{sim_u:>7}{p['generous_pct']:>11.1f}"
                     f"{sim_g:>7}{tps:>26}{p['cuts']:>6}{sim_c:>6}{p['pauses']:>8}"
                     f"{p['unfinished']:>7}{p['stalls']:>8}")
    v = summary.get("vs_fcfs")
    if v:
        low, high = v["bootstrap_95"]
        t_mean, t_half = v["t_95"]
        r_mean, r_half = v["throughput_ratio"]
        lines.append(f"slo - fcfs urgent TTFT attainment: {v['urgent_gain_points']:+.1f} points, "
                     f"paired bootstrap 95% [{low:+.1f}, {high:+.1f}]; per seed "
                     + " ".join(f"{g:+.0f}" for g in v["per_seed_gain"])
                     + f", t 95% [{t_mean - t_half:+.1f}, {t_mean + t_half:+.1f}]")
        lines.append(f"throughput slo/fcfs {r_mean:.3f} [{r_mean - r_half:.3f}, "
                     f"{r_mean + r_half:.3f}] (per seed "
                     + " ".join(f"{r:.3f}" for r in v["throughput_ratios"]) + ")")
        if "sim_gain" in v:
            g, gh = v["sim_gain"]
            s, sh = v["sim_throughput_ratio"]
            lines.append(f"simulator's prediction: urgent gain {g:+.1f} points "
                         f"[{g - gh:+.1f}, {g + gh:+.1f}], throughput slo/fcfs {s:.3f}")
        lines.append(verdict(v))
    return "\n".join(lines)


def verdict(v: dict) -> str:
    """The issue's real-engine targets: gain >= 15 points with the (bootstrap) interval above
    zero; throughput within 3% of fcfs's (the mean ratio)."""
    low = v["bootstrap_95"][0]
    ratio = v["throughput_ratio"][0]
    gain_ok = v["urgent_gain_points"] >= 15 and low > 0
    tput_ok = abs(ratio - 1) <= 0.03
    return (f"targets: gain >= 15 points, interval > 0: {'MET' if gain_ok else 'NOT MET'}; "
            f"throughput within 3%: {'MET' if tput_ok else 'NOT MET'}")


# ---- set-up: the model, solo probes, calibration -----------------------------------------------
def measure_machine(loaded, args, budget: int, max_len: int, blocks: int):
    """(solo TTFTs [(prompt tokens, seconds)], (a, b, c), decode step seconds), measured
    through an engine."""
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.request import SamplingParams

    config = EngineConfig.from_kwargs(model=args.model, dtype="float32", device="cpu",
                                      max_model_len=max_len, max_num_batched_tokens=budget,
                                      num_gpu_blocks_override=blocks)
    probe = LLMEngine(config, loaded=loaded)
    try:
        lo = scaled(MIX[0][1], args.scale)[0]
        hi = scaled(MIX[-1][1], args.scale)[1]
        lengths = sorted({lo + (hi - lo) * k // 3 for k in range(4)})
        chunks: list = []
        vocab = loaded.arch.vocab_size
        probes = {n: measure_solo_ttfts(probe, SamplingParams, n, args.solo_repeats, chunks,
                                        (min(FIRST_TEXT_TOKEN_ID, vocab // 2), vocab))
                  for n in lengths}
        decode = measure_decode_seconds(probe, SamplingParams)
    finally:
        probe.shutdown()
    measured = [(n, statistics.median(t)) for n, t in probes.items()]
    abc = fit_ttft_from_chunks(chunks, budget)
    print("solo TTFT (median of " + str(args.solo_repeats) + "): "
          + ", ".join(f"{n} tok {t * 1e3:.0f} ms" for n, t in measured)
          + f"; TTFT predictor a={abc[0] * 1e3:.3f} ms/tok b={abc[1] * 1e6:.4f} us/tok^2 "
          f"c={abc[2] * 1e3:.1f} ms; solo decode step {decode * 1e3:.1f} ms", flush=True)
    return measured, abc, decode


def calibrate(loaded, measured: "Measured", args, trace_dir: Path) -> dict:
    """A profile fitted to --calibration-runs traced fcfs runs at the highest load, seeds
    1000, 1001, ... (never a compared run's)."""
    from tokenweir.sim.calibrate_trace import calibrate_from_traces

    paths = []
    for k in range(args.calibration_runs):
        seed = 1000 + k
        items = make_items(args.calibration_requests or args.requests, seed, args.scale,
                           measured.solo)
        path = trace_dir / f"calibration-{seed}.jsonl"
        run_real(loaded, args.model, measured.setup, "fcfs", max(args.loads), seed, items,
                 max(args.loads) / measured.service, args, path)
        paths.append(str(path))
    profile = calibrate_from_traces(paths)
    held = profile.get("heldout", {})
    print(f"simulator profile: fitted to {len(paths)} calibration run(s) "
          f"({profile.get('num_steps')} steps); held-out step error mean "
          f"{100 * held.get('mean_rel_error', math.nan):.1f}%, summed time "
          f"{100 * held.get('total_rel_error', math.nan):+.1f}%", flush=True)
    return profile


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    p.add_argument("--scale", type=float, default=0.125,
                   help="prompt and output lengths and the token budget times this")
    p.add_argument("--loads", type=float, nargs="+", default=(1.0, 1.5),
                   help="rate as a multiple of 1 / mean solo service time")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--requests", type=int, default=48, help="requests per run")
    p.add_argument("--tpot-x", type=float, default=10.0,
                   help="TPOT target as a multiple of the solo decode step")
    p.add_argument("--solo-repeats", type=int, default=2)
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="a run stops this long after its last arrival (unfinished: misses)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibration-runs", type=int, default=1)
    p.add_argument("--calibration-requests", type=int, default=None, metavar="N",
                   help="requests per calibration run (default: --requests); the fit needs "
                        "more steps than its features, and a busy machine batches a short "
                        "run into fewer steps")
    p.add_argument("--sim-samples", type=int, default=8,
                   help="simulations per real run (draws of the calibrated machine)")
    p.add_argument("--slo", action="append", default=[], metavar="KEY=VALUE",
                   help="an slo policy setting for both sides, e.g. slo_max_preemptions=3")
    p.add_argument("--no-sim", action="store_true", help="skip calibration and simulation")
    p.add_argument("--reprobe", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the solo TTFTs again before every seed's pair of runs "
                        "(default: on, off with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="one seed, requests 8 (calibration 24), scale 1/32, loads 0.5 1.0 "
                        "(a smoke test)")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--save-calibration", metavar="PATH",
                   help="write the first probe and the fitted profile here (for --plan)")
    p.add_argument("--load-calibration", metavar="PATH",
                   help="the simulator's profile from a saved calibration (--save-calibration "
                        "on this machine, quiet) instead of a calibration run here")
    p.add_argument("--plan", metavar="PATH",
                   help="no engine: simulate a saved calibration at --loads and "
                        "--plan-requests to pick operating points")
    p.add_argument("--plan-requests", type=int, nargs="+", default=(24, 48, 64))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.requests, args.scale, args.loads = 1, 8, 1 / 32, (0.5, 1.0)
        args.calibration_requests = args.calibration_requests or 24
        args.solo_repeats, args.drain_seconds, args.sim_samples = 1, 10.0, 2
    if args.reprobe is None:
        args.reprobe = not args.quick
    return args


def parse_settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value) if value not in ("", None) else None
    return out


@dataclass(frozen=True)
class Measured:
    """The machine as the solo probes found it: targets, predictor, load scale."""

    points: tuple  # the solo probes: ((prompt tokens, seconds), ...)
    setup: Setup
    service: float  # mean solo service time, seconds
    decode_s: float  # the solo decode step

    def solo(self, prompt_len: int) -> float:
        return interpolate(list(self.points), prompt_len)


def measure(loaded, args, budget: int, max_len: int, blocks: int) -> Measured:
    points, abc, decode = measure_machine(loaded, args, budget, max_len, blocks)
    return measured_from(points, abc, decode, args, budget, max_len, blocks)


def measured_from(points, abc, decode: float, args, budget: int, max_len: int,
                  blocks: int) -> Measured:
    setup = Setup(budget, max_len, blocks, tuple(abc), args.tpot_x * decode * 1e3,
                  parse_settings(args.slo))
    solo = (lambda n: interpolate([tuple(p) for p in points], n))
    return Measured(tuple(tuple(p) for p in points), setup,
                    mean_service_seconds(args.scale, solo, decode), decode)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    import torch

    from tokenweir.model.loader import load_model

    args = parse_args(argv)
    if args.plan:
        return plan(args)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, torch.float32, torch.device("cpu"))
    budget, max_len, blocks = engine_shape(args.scale, args.requests)

    def probe() -> Measured:
        return measure(loaded, args, budget, max_len, blocks)

    first = probe()
    print(f"{args.model} float32, {args.threads} thread(s), budget {budget}, {args.requests} "
          f"requests per run, mean solo service {first.service:.2f} s, TPOT target "
          f"{first.setup.tpot_ms:.0f} ms, slo settings {first.setup.slo_extra or 'default'}"
          f" (slo_max_preemptions default {SchedulerConfig().slo_max_preemptions}); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    current = probe if args.reprobe else (lambda: first)
    if args.reprobe and args.load_calibration:  # no calibration run since the first probe:
        current = first_then(first, probe)      # the first seed uses it
    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        profile = None if args.no_sim else (
            json.loads(Path(args.load_calibration).read_text())["profile"]
            if args.load_calibration else calibrate(loaded, first, args, trace_dir))
        if args.save_calibration:
            save_calibration(Path(args.save_calibration), first, profile, args)
        for load in args.loads if args.seeds else ():  # --seeds 0: calibrate only
            comparison = compare_at(load, loaded, args, current, profile, trace_dir)
            summary = comparison.summary()
            summaries.append(summary)
            print(format_comparison(summary, args.seeds) + "\n", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return summaries


def first_then(first: Measured, probe: Callable[[], Measured]) -> Callable[[], Measured]:
    """A `current()` that returns `first` once, then probes anew on every call."""
    pending = [first]
    return lambda: pending.pop() if pending else probe()


def engine_shape(scale: float, requests: int) -> tuple[int, int, int]:
    """(token budget, max model length, KV blocks: every request's at once)."""
    budget = max(16, round(BUDGET * scale))
    max_len = scaled(MIX[-1][1], scale)[1] + scaled(OUTPUT_RANGE, scale)[1] + 16
    return budget, max_len, 4 * max_len * requests // 16 + 64


def save_calibration(path: Path, measured: Measured, profile: Optional[dict], args) -> None:
    """What --plan needs to simulate this machine: the solo probes, the TTFT predictor, the
    decode step and the trace-fitted profile."""
    path.write_text(json.dumps({
        "model": args.model, "scale": args.scale, "threads": args.threads,
        "points": measured.points, "ttft_abc": measured.setup.ttft_abc,
        "decode_s": measured.decode_s, "profile": profile}, indent=1))
    print(f"calibration saved to {path}", flush=True)


# ---- --plan: the simulator alone picks the operating points -------------------------------
def plan(args) -> list[dict]:
    """The simulator on a saved calibration (--save-calibration), no engine: per request count
    (--plan-requests) and load, fcfs and slo on the seeds' workloads (arrivals at the load's
    rate, --sim-samples draws of the machine each), printed as the real comparison is."""
    saved = json.loads(Path(args.plan).read_text())
    profile = saved["profile"]
    out = []
    for n in args.plan_requests:
        budget, max_len, blocks = engine_shape(args.scale, n)
        measured = measured_from(saved["points"], saved["ttft_abc"], saved["decode_s"], args,
                                 budget, max_len, blocks)
        for load in args.loads:
            comparison = Comparison(load)
            for seed in range(args.seed, args.seed + args.seeds):
                items = make_items(n, seed, args.scale, measured.solo)
                rate = load / measured.service
                arrivals = [(it.unit_arrival - items[0].unit_arrival) / rate for it in items]
                for policy in POLICIES:
                    shell = Run(policy, load, seed, arrivals, [], [it.urgent for it in items],
                                0, 0.0)
                    draws = simulate(profile, measured.setup, shell, items, args.sim_samples)
                    comparison.real.setdefault(policy, []).append(mean_run(draws))
                    comparison.sim.setdefault(policy, []).append(draws)
            summary = dict(comparison.summary(), requests=n)
            out.append(summary)
            print(f"[simulator only, {n} requests per run, "
                  f"{sum(it.urgent for it in items)} urgent in the last seed]")
            print(format_comparison(summary, args.seeds) + "\n", flush=True)
    return out


def mean_run(draws: list[Run]) -> Run:
    """The draws of one simulated run as one Run: a request meets its target when most draws
    say so; tokens and span averaged (the 'real' column of a --plan table)."""
    first = draws[0]
    met = [sum(d.ttft_met[i] for d in draws) * 2 > len(draws)
           for i in range(len(first.ttft_met))]
    return Run(first.policy, first.load, first.seed, first.arrivals, met, first.urgent,
               round(statistics.fmean(d.tokens for d in draws)),
               statistics.fmean(d.span_s for d in draws),
               cuts=round(statistics.fmean(d.cuts for d in draws)),
               pauses=round(statistics.fmean(d.pauses for d in draws)))


def compare_at(load: float, loaded, args, current: Callable[[], Measured],
               profile: Optional[dict], trace_dir: Path) -> Comparison:
    """Per seed, fcfs and slo on the same requests, their targets and rate from the machine as
    `current()` measures it just before (with --reprobe, anew for every seed: on a shared
    machine whose speed drifts by 2-3x over minutes, targets from an earlier probe would be
    too lax or too strict for both policies)."""
    comparison = Comparison(load)
    for k, seed in enumerate(range(args.seed, args.seed + args.seeds)):
        measured = current()
        items = make_items(args.requests, seed, args.scale, measured.solo)
        order = POLICIES if k % 2 == 0 else POLICIES[::-1]
        for policy in order:
            path = trace_dir / f"{policy}-{load}-{seed}.jsonl"
            run = run_real(loaded, args.model, measured.setup, policy, load, seed, items,
                           load / measured.service, args, path)
            comparison.real.setdefault(policy, []).append(run)
            if profile is not None:
                comparison.sim.setdefault(policy, []).append(
                    simulate(profile, measured.setup, run, items, args.sim_samples))
            print(f"  load {load:.2f} seed {seed} {policy:<5} urgent "
                  f"{run.attainment(True)[0]}/{run.attainment(True)[1]} generous "
                  f"{run.attainment(False)[0]}/{run.attainment(False)[1]} "
                  f"{run.throughput:.0f} tok/s span {run.span_s:.1f} s cuts {run.cuts} "
                  f"pauses {run.pauses} stalls {run.stalls} load avg {run.loadavg:.2f}",
                  flush=True)
    for policy in POLICIES:  # the per-seed lists in seed order whatever the run order
        comparison.real[policy].sort(key=lambda r: r.seed)
    for policy in comparison.sim:
        comparison.sim[policy].sort(key=lambda draws: draws[0].seed)
    return comparison


if __name__ == "__main__":
    main()
