"""Simulator fidelity: the same seeded workload and engine configuration on the real engine
(CPU, the default model, float32) and in the simulator driven by a calibrated step profile;
prints the relative error of total time, TTFT p50/p90 and TPOT p50/p90 (target: each within
10%; Vidur reports < 9%).

    python benchmarks/sim_fidelity.py                      # calibrate (default grid), then compare
    python benchmarks/sim_fidelity.py --profile P.json     # reuse a profile from `tokenweir calibrate`
    python benchmarks/sim_fidelity.py --quick              # smoke run: quick grid, 24 requests

Both sides measure the same way. Real engine: a submitter thread submits each request at its
arrival time (Poisson; `arrival_time` is stamped at submission), the main thread steps the
engine whenever it has work; TTFT is first-token time minus arrival, the first token's time
being the engine clock right after the step that sampled it (exactly what the simulator
reports: the end of that step). TPOT is (finish - first token) / (output tokens - 1); total
time is last finish minus first arrival. The simulator gets the arrival offsets the engine
actually saw (submission jitter of a few ms included), the same prompt and output lengths,
and the same scheduler configuration and KV pool.

Calibration and the engine run use the same torch thread count (`--threads`, default 1: on a
shared 2-core machine one thread times steadily; use 2 on a quiet one, for both). The engine is
warmed up (one request of each step kind) before the measured run. Runs ~2-4 minutes
(calibration ~2-3 more unless --profile is given).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._workload import FIRST_TEXT_TOKEN_ID  # noqa: E402
from tokenweir.sim.metrics import percentile  # noqa: E402
from tokenweir.sim.workload import RequestSpec, synthetic  # noqa: E402

TARGET = 0.10
METRICS = ("total_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", help="profile JSON (tokenweir calibrate); else calibrate first")
    p.add_argument("--save-profile", help="write the profile calibrated here")
    p.add_argument("--quick", action="store_true", help="quick grid and 24 requests")
    p.add_argument("--num-requests", type=int, default=None, help="default 80 (quick: 24)")
    p.add_argument("--request-rate", type=float, default=1.5, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", default="lognormal:64:0.6")
    p.add_argument("--output-len", default="uniform:8:40")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=1024, help="KV pool, null block included")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write both sides' metrics and errors here")
    return p.parse_args()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The configuration both sides run."""
    return {"max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "num_gpu_blocks_override": args.num_gpu_blocks,
            "seed": args.seed}


def prompts_for(specs: list[RequestSpec], seed: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TEXT_TOKEN_ID, vocab_size) for _ in range(s.prompt_len)]
            for s in specs]


# ---- the real engine -----------------------------------------------------------------------
def run_engine(args: argparse.Namespace, loaded, specs: list[RequestSpec]) -> list[dict]:
    """Serve `specs` on the real engine with live Poisson arrivals; one record per request:
    arrival, first_token, finished (engine clock, seconds) and num_output."""
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.request import SamplingParams

    config = EngineConfig.from_kwargs(model=args.model, dtype="float32", device="cpu",
                                      **engine_kwargs(args))
    engine = LLMEngine(config, loaded=loaded)
    prompts = prompts_for(specs, args.seed, loaded.arch.vocab_size)
    _warm_up(engine, prompts[0][:32])
    requests = []

    def submit() -> None:
        start = time.monotonic()
        for spec, prompt in zip(specs, prompts):
            delay = start + spec.arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
            request, _ = engine.make_request(prompt, params, request_id=spec.request_id)
            requests.append(request)
            engine.submit_request(request, None)

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    done = 0
    while done < len(specs):
        if engine.has_unfinished_requests():
            done += sum(1 for out in engine.step() if out.finished)
        else:
            time.sleep(0.0005)
    submitter.join()
    return [{"request_id": r.request_id, "arrival": r.arrival_time, "first_token":
             r.first_token_time, "finished": r.finished_time,
             "num_output": r.num_output_tokens} for r in requests]


def _warm_up(engine, prompt: list[int]) -> None:
    """One-off set-up costs (first prefill, first decode, first mixed step) before timing."""
    from tokenweir.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(2):
        request, _ = engine.make_request(prompt[: 16 + 8 * i], params, request_id=f"warm{i}")
        engine.add_request(request, None)
        for _ in range(2):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


# ---- the simulator -------------------------------------------------------------------------
def run_sim(args: argparse.Namespace, profile: dict, specs: list[RequestSpec]) -> list[dict]:
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.latency import FittedLatencyModel

    sim = build_simulation(engine_kwargs(args), specs,
                           latency_model=FittedLatencyModel.from_profile(profile),
                           itl_counts=True)
    result = sim.run()
    return [{"request_id": r.request_id, "arrival": r.arrival, "first_token": r.first_token,
             "finished": r.finished, "num_output": r.num_output} for r in result.requests]


# ---- comparison ----------------------------------------------------------------------------
def summarize(records: list[dict]) -> dict:
    ttft = sorted(r["first_token"] - r["arrival"] for r in records)
    tpot = sorted((r["finished"] - r["first_token"]) / (r["num_output"] - 1)
                  for r in records if r["num_output"] > 1)
    span = max(r["finished"] for r in records) - min(r["arrival"] for r in records)
    return {"total_s": span,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p90_ms": 1000 * percentile(ttft, 90),
            "tpot_p50_ms": 1000 * percentile(tpot, 50), "tpot_p90_ms": 1000 * percentile(tpot, 90)}


def realized_specs(specs: list[RequestSpec], records: list[dict]) -> list[RequestSpec]:
    """The workload as the engine saw it: arrival offsets measured from the first arrival."""
    by_id = {r["request_id"]: r for r in records}
    first = min(r["arrival"] for r in records)
    return [RequestSpec(s.request_id, by_id[s.request_id]["arrival"] - first, s.prompt_len,
                        s.output_len, index=s.index) for s in specs]


def main() -> int:
    args = parse_args()
    n = args.num_requests or (24 if args.quick else 80)
    import torch

    from tokenweir.model.loader import load_model
    from tokenweir.sim.calibrate import calibrate, format_report, load_profile

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, torch.float32, torch.device("cpu"))
    if args.profile:
        profile = load_profile(args.profile)
        if profile.get("threads") != args.threads:
            print(f"warning: the profile was timed with {profile.get('threads')} thread(s), "
                  f"the engine runs with {args.threads}", file=sys.stderr)
    else:
        started = time.perf_counter()
        profile = calibrate(args.model, "quick" if args.quick else "default",
                            threads=args.threads, loaded=loaded)
        print(f"calibrated in {time.perf_counter() - started:.0f} s")
        if args.save_profile:
            with open(args.save_profile, "w") as f:
                json.dump(profile, f, indent=1)
    print(format_report(profile))
    specs = synthetic(n, args.request_rate, seed=args.seed, prompt=args.prompt_len,
                      output=args.output_len, max_model_len=args.max_model_len)
    started = time.perf_counter()
    real = run_engine(args, loaded, specs)
    engine_seconds = time.perf_counter() - started
    simulated = run_sim(args, profile, realized_specs(specs, real))
    ours, theirs = summarize(simulated), summarize(real)
    errors = {k: (ours[k] - theirs[k]) / theirs[k] for k in METRICS}
    print(f"\nworkload: {n} requests, Poisson {args.request_rate}/s, prompts {args.prompt_len}, "
          f"outputs {args.output_len}; budget {args.max_num_batched_tokens}, "
          f"max_num_seqs {args.max_num_seqs}, {args.threads} thread(s); "
          f"engine run {engine_seconds:.0f} s")
    print(f"{'metric':14s} {'real engine':>12s} {'simulator':>12s} {'rel. error':>11s}")
    for k in METRICS:
        flag = "ok" if abs(errors[k]) <= TARGET else "MISS"
        print(f"{k:14s} {theirs[k]:12.2f} {ours[k]:12.2f} {100 * errors[k]:+10.1f}%  {flag}")
    worst = max(abs(e) for e in errors.values())
    print(f"worst |error| {100 * worst:.1f}% (target <= {100 * TARGET:.0f}% each)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"real": theirs, "sim": ours, "rel_error": errors,
                       "engine_seconds": engine_seconds, "profile_fit": profile["fit"]}, f,
                      indent=1)
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
