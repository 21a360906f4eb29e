"""What penalties and logit_bias cost per step (issue 15), and that a plain batch pays nothing.

Everything runs in ONE process, the sides alternating call by call (A B A B ...), so that a
busy, shared machine slows both sides alike; medians and ratios are of those interleaved runs.

1. sampler: `sample()` on [rows, 49,152] float32 logits (half greedy rows, half seeded top-p),
   - plain batch, this checkout vs the sampler of a checkout from before (`--baseline`);
   - this checkout, every row penalized (repetition 1.2, presence 0.5, frequency 0.5; 512
     prompt + 128 output tokens each) or biased (20 tokens), against the plain batch;
2. engine: decode steps of SmolLM2-135M (float32, shared weights) with `rows` requests, two
   engines stepped alternately: plain requests with the baseline's sampler vs plain requests
   with this checkout's (before/after), then plain vs penalized requests (this checkout).

    python benchmarks/penalties_overhead.py --baseline /tmp/base   # e.g. a `git archive` of main
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Callable

import torch

from tokenweir.model import sampler as after_sampler
from tokenweir.request import SamplingParams

EOS = frozenset({2})


def load_baseline_sampler(root: str):
    """The baseline checkout's model/sampler.py, importing the rest from this checkout (its
    imports, SamplingParams and TokenLogprobs, are compatible)."""
    path = os.path.join(root, "tokenweir", "model", "sampler.py")
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_params(kind: str, rows: int, max_tokens: int = 16) -> list[SamplingParams]:
    extra = {"penalties": dict(repetition_penalty=1.2, presence_penalty=0.5,
                               frequency_penalty=0.5),
             "bias": dict(logit_bias={t: 1.5 for t in range(100, 2100, 100)})}.get(kind, {})
    return [SamplingParams(temperature=0 if i % 2 else 0.8, top_p=0.95, seed=i,
                           max_tokens=max_tokens, ignore_eos=True, **extra)
            for i in range(rows)]


def interleave(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    """Call each fn once per round, in turn, `reps` rounds (after one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    return times


def report(title: str, times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(title)
    for name, values in times.items():
        print(f"  {name:28s} median {med[name]:8.3f} ms   min {min(values) * 1e3:8.3f} ms"
              f"   ({len(values)} runs)")
    for a, b in pairs:
        print(f"  {a} / {b}: {med[a] / med[b]:.3f}")


def bench_sampler(rows: int, reps: int, baseline) -> None:
    torch.manual_seed(0)
    logits = torch.randn(rows, 49152) * 3
    hist = [list(range(i, i + 640)) for i in range(rows)]
    n_out = [128] * rows
    plain = make_params("plain", rows)
    fns = {}
    if baseline is not None:
        fns["before: plain"] = lambda: baseline.sample(logits, plain, n_out, EOS, 0, 1)
    fns["after: plain"] = lambda: after_sampler.sample(logits, plain, n_out, EOS, 0, 1,
                                                       token_ids=hist)
    for kind in ("penalties", "bias"):
        params = make_params(kind, rows)
        fns[f"after: {kind}"] = (lambda p=params: after_sampler.sample(
            logits, p, n_out, EOS, 0, 1, token_ids=hist))
    pairs = [("after: penalties", "after: plain"), ("after: bias", "after: plain")]
    if baseline is not None:
        pairs.insert(0, ("after: plain", "before: plain"))
    report(f"sampler, {rows} rows x 49,152, {torch.get_num_threads()} thread(s)",
           interleave(fns, reps), pairs)


def _engine(loaded, rows: int, kind: str, steps: int):
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine
    config = EngineConfig.from_kwargs(model="smollm2-135m", dtype="float32", device="cpu",
                                      max_model_len=1024, num_gpu_blocks_override=1024)
    engine = LLMEngine(config, loaded=loaded)
    for i, p in enumerate(make_params(kind, rows, max_tokens=steps + 8)):
        prompt = {"prompt_token_ids": [(i * 37 + j * 11) % 40000 + 100 for j in range(48)]}
        request, text = engine.make_request(prompt, p)
        engine.add_request(request, text)
    for _ in range(4):  # past the prefills: every request decoding from here on
        engine.step()
    return engine


def bench_engine(rows: int, steps: int, baseline) -> None:
    import tokenweir.runner.model_runner as runner_module
    from tokenweir.model.loader import load_model
    loaded = load_model("smollm2-135m", torch.float32, torch.device("cpu"))
    after_fn = runner_module.sample_isolated

    def with_sampler(engine, fn):
        def step() -> None:
            runner_module.sample_isolated = fn
            try:
                engine.step()
            finally:
                runner_module.sample_isolated = after_fn
        return step

    fns = {}
    if baseline is not None:
        def before_fn(*args, token_ids=None, **kwargs):  # the baseline takes no token ids
            return baseline.sample_isolated(*args, **kwargs)
        fns["before: plain step"] = with_sampler(_engine(loaded, rows, "plain", steps),
                                                 before_fn)
    fns["after: plain step"] = with_sampler(_engine(loaded, rows, "plain", steps), after_fn)
    fns["after: penalized step"] = with_sampler(_engine(loaded, rows, "penalties", steps),
                                                after_fn)
    pairs = [("after: penalized step", "after: plain step")]
    if baseline is not None:
        pairs.insert(0, ("after: plain step", "before: plain step"))
    report(f"engine decode step, SmolLM2-135M float32, {rows} requests, "
           f"{torch.get_num_threads()} thread(s)", interleave(fns, steps), pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="a checkout from before this work")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_baseline_sampler(args.baseline) if args.baseline else None
    with torch.inference_mode():
        bench_sampler(args.rows, args.reps, baseline)
    if not args.skip_engine:
        bench_engine(args.rows, args.steps, baseline)


if __name__ == "__main__":
    main()
