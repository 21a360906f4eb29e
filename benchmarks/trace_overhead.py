"""What `--trace FILE` costs: the same offline workload on the real engine with and without
tracing, in alternating rounds (so load from other processes hits both alike), plus the
tracer's own time per step measured inside the engine (its observer call, output hook and
JSON line). Target: < 2% of step time.

    python benchmarks/trace_overhead.py                 # 16 prompts x 32 tokens, 3 rounds each
    python benchmarks/trace_overhead.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def one_run(args, loaded, trace_path) -> tuple[float, int, float]:
    """(wall seconds, steps, seconds inside the tracer) of one run of the workload."""
    from tokenweir import LLM, SamplingParams
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine

    kwargs = dict(model=args.model, dtype="float32", device="cpu", max_model_len=1024,
                  max_num_batched_tokens=256, num_gpu_blocks_override=1024)
    if trace_path:
        kwargs["step_trace"] = str(trace_path)
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**kwargs), loaded=loaded))
    engine, spent = llm.llm_engine, [0.0]
    if engine.tracer is not None:
        tracer = engine.tracer

        def timed(fn):
            def call(*a):
                started = time.perf_counter()
                fn(*a)
                spent[0] += time.perf_counter() - started
            return call
        engine.core.step_observers[engine.core.step_observers.index(tracer)] = timed(tracer)
        tracer.output_processed = timed(tracer.output_processed)
    prompts = [{"prompt_token_ids": [300 + (i * 37 + k) % 4000 for k in range(48 + 8 * i)]}
               for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    steps = engine.scheduler.stats.num_steps
    engine.close()
    return wall, steps, spent[0]


def main() -> int:
    args = parse_args()
    import torch

    from tokenweir.model.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, torch.float32, torch.device("cpu"))
    one_run(args, loaded, None)  # warm-up: one-off kernel and allocator set-up
    plain, traced, inside, steps = [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            plain.append(one_run(args, loaded, None)[0])
            wall, steps, spent = one_run(args, loaded, Path(tmp) / f"r{i}.jsonl")
            traced.append(wall)
            inside.append(spent / wall)
    a, b = statistics.median(plain), statistics.median(traced)
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, {steps} steps, {args.threads} "
          f"thread(s), {args.rounds} alternating rounds")
    print(f"without --trace: median {a:.3f} s   rounds {', '.join(f'{x:.3f}' for x in plain)}")
    print(f"with --trace:    median {b:.3f} s   rounds {', '.join(f'{x:.3f}' for x in traced)}")
    print(f"wall-time difference {100 * (b / a - 1):+.2f}% (noise included); time inside the "
          f"tracer {100 * statistics.median(inside):.3f}% of the traced run "
          f"({1e6 * statistics.median(inside) * b / steps:.0f} us per step)")
    return 0 if statistics.median(inside) < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
