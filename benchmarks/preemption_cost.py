"""What load-shedding costs: preemption mode x victim policy under memory pressure, and what
prefix caching saves on time-to-first-token.

Part 1: a shared 512-token system prompt, varied user prompts, long generations, in a KV pool
sized to force preemption. For each (preemption_mode, preemption_policy): total time, output
tokens/s, preemptions, swaps, and the recompute tax = tokens recomputed / tokens generated.
Target: the best `auto` + `cost` run cuts the tax >= 2x against `recompute` + `fcfs`, at equal
or better throughput.

Part 2: requests sharing a 1,024-token prefix, one after another; mean TTFT with the prefix
cache on vs off, as a ratio.

One process, one set of weights shared by every engine, so the rows compare like with like.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._workload import FIRST_TEXT_TOKEN_ID, VOCAB_SIZE  # noqa: E402
from tokenweir import SamplingParams  # noqa: E402
from tokenweir.config import EngineConfig  # noqa: E402
from tokenweir.engine.llm import LLM  # noqa: E402
from tokenweir.engine.llm_engine import LLMEngine, resolve_dtype  # noqa: E402
from tokenweir.model.loader import load_model  # noqa: E402

MODES = ("recompute", "swap", "auto")
POLICIES = ("fcfs", "priority", "cost")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TEXT_TOKEN_ID, VOCAB_SIZE) for _ in range(n)]


def pressure_workload(num_requests: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = random_tokens(rng, system_len)
    return [system + random_tokens(rng, rng.randint(16, 128)) for _ in range(num_requests)]


def metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "tokenweir:" + name)


def build(loaded, args, **kwargs) -> LLM:
    config = EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget, seed=0, **kwargs)
    return LLM.from_engine(LLMEngine(config, loaded=loaded))


def run_pressure(loaded, args) -> list[dict]:
    prompts = [{"prompt_token_ids": p}
               for p in pressure_workload(args.num_requests, args.system_len, args.seed)]
    priorities = [i % 3 for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for mode, victims in itertools.product(MODES, POLICIES):
        llm = build(loaded, args, num_gpu_blocks_override=args.num_blocks,
                    preemption_mode=mode, preemption_policy=victims,
                    scheduling_policy="priority" if victims == "priority" else "fcfs",
                    scheduler_reserve_full_isl=False, swap_space=args.swap_space)
        start = time.perf_counter()
        outs = llm.generate(prompts, params,
                            priority=priorities if victims == "priority" else None,
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(dict(mode=mode, policy=victims, seconds=seconds, tok_s=generated / seconds,
                         preemptions=metric(llm, "num_preemptions"),
                         swaps=metric(llm, "num_swapped_out"),
                         recomputed=metric(llm, "recomputed_tokens"), generated=generated,
                         tax=metric(llm, "recomputed_tokens") / generated))
        print(f"  {mode:9s} {victims:8s} {seconds:7.1f} s {rows[-1]['tok_s']:7.1f} tok/s "
              f"preempt {rows[-1]['preemptions']:4d} swaps {rows[-1]['swaps']:4d} "
              f"tax {rows[-1]['tax']:.3f}", flush=True)
    return rows


def run_prefix_ttft(loaded, args) -> dict:
    rng = random.Random(args.seed + 1)
    prefix = random_tokens(rng, 1024)
    prompts = [prefix + random_tokens(rng, 32) for _ in range(args.prefix_requests)]
    params = SamplingParams(temperature=0, max_tokens=1)
    result = {}
    for enabled in (False, True):
        llm = build(loaded, args, enable_prefix_caching=enabled)
        llm.generate({"prompt_token_ids": random_tokens(rng, 64)}, params, use_tqdm=False)
        ttfts = []
        for prompt in prompts:  # one at a time: TTFT is the prefill itself
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            ttfts.append(out.metrics.time_to_first_token)
        # The first request fills the cache; later ones are what the cache serves.
        result["on" if enabled else "off"] = sum(ttfts[1:]) / len(ttfts[1:])
        result[f"hits_{'on' if enabled else 'off'}"] = metric(llm, "prefix_cache_hits")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=140,
                        help="KV pool (blocks of 16): sized to force preemption")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1536)
    parser.add_argument("--swap-space", type=float, default=0.5)
    parser.add_argument("--prefix-requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_len, args.num_blocks, args.prefix_requests = 8, 48, 100, 3
    torch.manual_seed(0)
    loaded = load_model(args.model, resolve_dtype(args.dtype, torch.device("cpu")),
                        torch.device("cpu"))
    print(f"preemption cost: {args.num_requests} requests, {args.system_len}-token shared "
          f"system prompt + 16-128 user tokens, {args.output_len} output tokens each, "
          f"pool {args.num_blocks} blocks x 16, budget {args.budget}, {args.dtype}")
    rows = run_pressure(loaded, args)
    base = next(r for r in rows if r["mode"] == "recompute" and r["policy"] == "fcfs")
    best = min((r for r in rows if r["mode"] == "auto" and r["policy"] == "cost"),
               key=lambda r: r["tax"])
    cut = base["tax"] / best["tax"] if best["tax"] else float("inf")
    speed = best["tok_s"] / base["tok_s"]
    print(f"recompute tax: recompute+fcfs {base['tax']:.3f} vs auto+cost {best['tax']:.3f} "
          f"-> cut {cut:.1f}x (target >= 2x); throughput ratio {speed:.2f} (target >= 1.0): "
          f"{'PASS' if cut >= 2 and speed >= 1.0 else 'FAIL'}")
    ttft = run_prefix_ttft(loaded, args)
    print(f"prefix cache, 1,024-token shared prefix: mean TTFT off {1000 * ttft['off']:.0f} ms, "
          f"on {1000 * ttft['on']:.0f} ms -> {ttft['off'] / ttft['on']:.1f}x faster "
          f"(hit tokens: {ttft['hits_on']:.0f} on, {ttft['hits_off']:.0f} off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
