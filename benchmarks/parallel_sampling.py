"""Parallel sampling on shared KV blocks (issue 15): what sharing the prompt buys.

Section `parallel`: the same prompts, each asked for n = 1, 4, 8 samples, three ways in one
process on one set of weights (every engine is built on them; none is timed loading):

- `shared`: one request with `SamplingParams(n=n)`: the prompt is prefilled once and the n
  samples fork its KV blocks (ref counts; copy-on-write of the last block);
- `separate`: n requests of the same prompt (seeds seed + i, so exactly the same samples),
  prefix caching off: every prompt computed and stored n times;
- `separate+cache`: the same n requests with prefix caching on (what vLLM v1 does for n):
  full prompt blocks computed once and shared when a copy is admitted after the first
  finished its prefill; copies admitted in the same step still compute their own.

For each: seconds, output tok/s, tokens computed (prompt and output), peak KV blocks held
(sampled after every schedule), and the fraction of samples identical to the `shared` ones.
Then the ratios separate / shared. Timings are indicative on a shared machine; the block
counts and computed tokens are exact. Identical samples are expected but not guaranteed: a
step's batch shape changes float32 rounding (~1e-7) in the forward, and an inverse-CDF draw
whose uniform falls that close to a boundary moves to a neighbouring token id; sampling
itself is batch-independent (model/sampler.py).

Other sections (guided decoding) may be added: `SECTIONS` maps a name to a function
(loaded model, args) -> printed rows; `--section` picks (default: all).

    python benchmarks/parallel_sampling.py                 # SmolLM2-135M, float32
    python benchmarks/parallel_sampling.py --quick         # 4 prompts x 64 tokens, 8 out
    python benchmarks/parallel_sampling.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._workload import FIRST_TEXT_TOKEN_ID, VOCAB_SIZE  # noqa: E402
from tokenweir import SamplingParams  # noqa: E402
from tokenweir.config import EngineConfig  # noqa: E402
from tokenweir.engine.llm import LLM  # noqa: E402
from tokenweir.engine.llm_engine import LLMEngine, resolve_dtype  # noqa: E402
from tokenweir.model.loader import load_model  # noqa: E402

ARMS = ("shared", "separate", "separate+cache")


class StepProbe:
    """Wraps an engine's executor: peak KV blocks held and tokens computed, per run."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.core
        self.kv = core.scheduler.kv
        self.execute, core.executor.execute = core.executor.execute, self._execute
        self.peak_blocks = 0
        self.scheduled_tokens = 0

    def _execute(self, out):
        held = self.kv.num_usable_blocks - self.kv.num_free_blocks
        self.peak_blocks = max(self.peak_blocks, held)
        self.scheduled_tokens += out.total_num_scheduled_tokens
        return self.execute(out)


def make_prompts(count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(FIRST_TEXT_TOKEN_ID, VOCAB_SIZE)
                                  for _ in range(length)]} for _ in range(count)]


def build(loaded, args, prefix_caching: bool) -> LLM:
    config = EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.output_len + 16,
        num_gpu_blocks_override=args.num_blocks, max_num_batched_tokens=args.budget,
        enable_prefix_caching=prefix_caching, seed=0)
    return LLM.from_engine(LLMEngine(config, loaded=loaded))


def run_arm(loaded, args, arm: str, n: int, prompts: list[dict]) -> tuple[dict, list]:
    """One arm at one n: its row and its samples (per prompt, per sample index)."""
    llm = build(loaded, args, prefix_caching=arm == "separate+cache")
    llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    probe = StepProbe(llm)
    base = dict(temperature=1.0, top_p=0.95, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    if arm == "shared":
        outs = llm.generate(prompts, SamplingParams(n=n, seed=args.seed, **base), use_tqdm=False)
        samples = [[c.token_ids for c in o.outputs] for o in outs]
    else:
        params = [SamplingParams(seed=args.seed + i, **base) for _ in prompts for i in range(n)]
        outs = llm.generate([p for p in prompts for _ in range(n)], params, use_tqdm=False)
        samples = [[o.outputs[0].token_ids for o in outs[k * n:(k + 1) * n]]
                   for k in range(len(prompts))]
    seconds = time.perf_counter() - start
    generated = sum(len(t) for per_prompt in samples for t in per_prompt)
    preemptions = next(m.value for m in llm.get_metrics()
                       if m.name == "tokenweir:num_preemptions")
    return dict(n=n, arm=arm, seconds=seconds, output_tok_s=generated / seconds,
                generated=generated, computed_tokens=probe.scheduled_tokens,
                peak_blocks=probe.peak_blocks, preemptions=preemptions), samples


def parallel_section(loaded, args) -> list[dict]:
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed)
    rows = []
    print(f"\n== parallel sampling: {args.num_prompts} prompts x {args.prompt_len} tokens, "
          f"{args.output_len} out per sample, pool {args.num_blocks} blocks ==")
    print(f"{'n':>2} {'arm':<15} {'s':>7} {'out tok/s':>10} {'computed':>9} "
          f"{'peak blocks':>11} {'preempt':>7} {'identical':>9}")
    for n in args.n:
        reference = None
        for arm in ARMS:
            row, samples = run_arm(loaded, args, arm, n, prompts)
            reference = samples if reference is None else reference
            row["identical"] = identical_fraction(samples, reference)
            rows.append(row)
            print(f"{n:>2} {arm:<15} {row['seconds']:>7.2f} {row['output_tok_s']:>10.1f} "
                  f"{row['computed_tokens']:>9} {row['peak_blocks']:>11} "
                  f"{row['preemptions']:>7.0f} {row['identical']:>9.3f}")
        print_ratios(rows[-len(ARMS):])
    return rows


def identical_fraction(samples: list, reference: list) -> float:
    pairs = [(a, b) for p, q in zip(samples, reference) for a, b in zip(p, q)]
    return sum(a == b for a, b in pairs) / len(pairs)


def print_ratios(rows: list[dict]) -> None:
    shared = rows[0]
    for other in rows[1:]:
        print(f"   {other['arm']} / shared: peak blocks "
              f"{other['peak_blocks'] / max(1, shared['peak_blocks']):.2f}x, computed tokens "
              f"{other['computed_tokens'] / max(1, shared['computed_tokens']):.2f}x, output "
              f"tok/s {other['output_tok_s'] / shared['output_tok_s']:.2f}x")


# name -> function(loaded model, args) -> rows; a new section adds itself here
SECTIONS: dict[str, Callable] = {"parallel": parallel_section}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--section", choices=sorted(SECTIONS), action="append",
                   help="run only this section (repeatable; default: all)")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=1400,
                   help="KV pool (blocks of 16): roomy enough that no arm preempts")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens, 8 out")
    p.add_argument("--json", help="write every section's rows here")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.prompt_len, args.output_len = 4, 64, 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    print(f"model {args.model}, {dtype}, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    loaded = load_model(args.model, dtype, torch.device("cpu"))
    results = {name: SECTIONS[name](loaded, args) for name in (args.section or SECTIONS)}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
