"""What --batch-invariant costs (issue 38): offline throughput of a 64-request workload (W64)
and single-stream decode speed (and one 1000-token prefill), with and without the flag, in float32 and bfloat16, all in ONE
process and run: per dtype the model loads once and the two engines (flag off / on) share it,
their runs alternating (off, on, off, on, ...) so a busy machine slows both alike. Medians of
the alternated runs and the ratio on / off are printed (targets: <= 15% slower in bfloat16,
<= 10% in float32). It also counts the W64 requests whose tokens were identical with and
without the flag (informative: the flag changes the order of sums, so some may differ).

    python benchmarks/batch_invariance.py                  # SmolLM2-135M, both dtypes
    python benchmarks/batch_invariance.py --quick --model DIR   # seconds: a dry run of it all

Say which CPU a figure came from: the bfloat16 figures of an AVX2-only machine (no AVX-512
BF16) measure emulated bfloat16 matmuls on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import DEFAULT_MODEL, make_workload  # noqa: E402

from tokenweir import LLM, SamplingParams  # noqa: E402
from tokenweir.config import EngineConfig  # noqa: E402
from tokenweir.cpu_info import kernel_flags  # noqa: E402
from tokenweir.engine.llm_engine import LLMEngine  # noqa: E402
from tokenweir.model.loader import load_model  # noqa: E402

DTYPES = ("float32", "bfloat16")
MEASURES = ("w64_out_tok_s", "single_decode_tok_s", "long_prefill_tok_s")


def cpu_flags() -> str:
    """The instruction sets that decide these figures (AVX2 / AVX-512 / AVX-512 BF16 / AMX)."""
    return ",".join(kernel_flags()) or "unknown"


def build_engine(args, loaded, dtype: str, invariant: bool) -> LLM:
    budget = {} if args.budget is None else {"max_num_batched_tokens": args.budget}
    config = EngineConfig.from_kwargs(model=args.model, dtype=dtype, device="cpu",
                                      batch_invariant=invariant, enable_prefix_caching=False,
                                      max_model_len=args.max_model_len, kv_cache_space=0.5,
                                      **budget)
    return LLM.from_engine(LLMEngine(config, loaded=loaded))


def offline(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    """Output tokens per second of one generate() over every prompt, and the token ids."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, \
        [o.outputs[0].token_ids for o in outs]


def single_stream(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens per second of one request: tokens after the first over their time."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def long_prefill(llm: LLM, prompt: list[int]) -> float:
    """Prompt tokens per second of one long prompt's prefill (time to its first token): where
    the invariant attention (one row per work item) costs the most."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return len(prompt) / out.metrics.time_to_first_token


def alternate(runs: dict[bool, Callable[[], Any]], repeats: int) -> dict[bool, list]:
    """runs[False](), runs[True](), ... `repeats` rounds after one warm-up round."""
    results: dict[bool, list] = {flag: [] for flag in runs}
    for rep in range(repeats + 1):
        for flag, fn in runs.items():
            value = fn()
            if rep:
                results[flag].append(value)
    return results


def measure_dtype(args, dtype: str) -> dict:
    workload = make_workload(args.requests, args.min_prompt, args.max_prompt, args.output_len,
                             seed=0, token_range=tuple(args.token_range))
    loaded = load_model(args.model, getattr(torch, dtype), torch.device("cpu"))
    engines = {flag: build_engine(args, loaded, dtype, flag) for flag in (False, True)}
    # each engine sets batch_invariant on the shared model when built: re-assert it per run
    def run(flag: bool, fn: Callable[[LLM], Any]) -> Callable[[], Any]:
        def go():
            from tokenweir.model.layers import set_batch_invariant
            set_batch_invariant(loaded.model, flag)
            return fn(engines[flag])
        return go
    w64 = alternate({f: run(f, lambda llm: offline(llm, workload.prompts, workload.output_len))
                     for f in (False, True)}, args.repeats)
    single = alternate({f: run(f, lambda llm: single_stream(llm, workload.prompts[0],
                                                            args.single_tokens))
                        for f in (False, True)}, args.repeats)
    long_prompt = make_workload(1, args.long_prompt, args.long_prompt, 1, seed=1,
                                token_range=tuple(args.token_range)).prompts[0]
    prefill = alternate({f: run(f, lambda llm: long_prefill(llm, long_prompt))
                         for f in (False, True)}, args.repeats)
    same = sum(a == b for a, b in zip(w64[False][-1][1], w64[True][-1][1]))
    result = {"dtype": dtype, "same_tokens": same, "requests": workload.num_requests}
    for name, runs in (("w64_out_tok_s", {f: [r[0] for r in w64[f]] for f in w64}),
                       ("single_decode_tok_s", single), ("long_prefill_tok_s", prefill)):
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        result[name] = {"off": off, "on": on, "on_over_off": on / off,
                        "runs_off": runs[False], "runs_on": runs[True]}
    return result


def print_table(results: list[dict]) -> None:
    print(f"{'dtype':9s} {'measure':22s} {'flag off':>10s} {'flag on':>10s} {'on/off':>7s}",
          flush=True)
    for r in results:
        for name in MEASURES:
            m = r[name]
            print(f"{r['dtype']:9s} {name:22s} {m['off']:10.1f} {m['on']:10.1f} "
                  f"{m['on_over_off']:7.3f}")
        print(f"{r['dtype']:9s} W64 requests with identical tokens off vs on: "
              f"{r['same_tokens']} of {r['requests']}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--single-tokens", type=int, default=32)
    p.add_argument("--long-prompt", type=int, default=1000, help="tokens of the long prefill")
    p.add_argument("--budget", type=int, default=None,
                   help="max_num_batched_tokens (default: the engine's)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--token-range", type=int, nargs=2, default=[252, 49_152])
    p.add_argument("--quick", action="store_true",
                   help="8 requests, 4 tokens, 1 repeat: checks the script, measures nothing")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.output_len, args.single_tokens, args.repeats = 8, 4, 4, 1
        args.max_prompt, args.long_prompt = min(args.max_prompt, 48), min(args.long_prompt, 96)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    os.environ.setdefault("TOKENWEIR_WARMUP", "0")  # both sides warm up in the first round
    print(f"cpu: {cpu_flags()}; torch threads {torch.get_num_threads()}; model {args.model}",
          flush=True)
    results = []
    for dtype in args.dtypes:  # each dtype's table as soon as it is measured
        results.append(measure_dtype(args, dtype))
        print_table(results[-1:])
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu_flags(), "args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
