"""What penalties and logit_bias cost per step (issue 15), and that a plain batch pays nothing.

Two measurements, each in child processes that import tokenweir from a given checkout, run
alternately (A B A B ...) so that a busy machine hurts both sides alike; the best of the
rounds is reported:

1. sampler: `sample()` on [rows, 49,152] float32 logits (half greedy, half seeded top-p rows),
   for a plain batch, and (this checkout only) with every row penalized (repetition 1.2,
   presence 0.5, frequency 0.5; 512 prompt + 128 output tokens each) or biased (20 tokens);
2. engine: the median decode step of SmolLM2-135M (float32) with `rows` requests decoding,
   plain or penalized.

    python benchmarks/penalties_overhead.py --baseline /tmp/base   # a checkout from before

With `--baseline`, the plain batch runs on both checkouts: the "after / before" ratio is the
cost of this work on requests that do not use it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(kind: str, rows: int, max_tokens: int = 16):
    from tokenweir.request import SamplingParams
    extra = {"penalties": dict(repetition_penalty=1.2, presence_penalty=0.5,
                               frequency_penalty=0.5),
             "bias": dict(logit_bias={t: 1.5 for t in range(100, 2100, 100)})}.get(kind, {})
    return [SamplingParams(temperature=0 if i % 2 else 0.8, top_p=0.95, seed=i,
                           max_tokens=max_tokens, ignore_eos=True, **extra)
            for i in range(rows)]


def child_sampler(kind: str, rows: int, reps: int) -> dict:
    import torch
    from tokenweir.model import sampler
    torch.manual_seed(0)
    logits = torch.randn(rows, 49152) * 3
    params = _params(kind, rows)
    hist = [list(range(i, i + 640)) for i in range(rows)]
    kwargs = {} if kind == "plain" else {"token_ids": hist}
    n_out = [128] * rows
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sampler.sample(logits, params, n_out, frozenset({2}), 0, 1, **kwargs)
        times.append(time.perf_counter() - start)
    return {"best_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}


def child_engine(kind: str, rows: int, steps: int) -> dict:
    from tokenweir import LLM
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=1024,
              num_gpu_blocks_override=1024)
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 40000 + 100 for j in range(48)]}
               for i in range(rows)]
    for prompt, p in zip(prompts, _params(kind, rows, max_tokens=steps + 8)):
        request, text = engine.make_request(prompt, p)
        engine.add_request(request, text)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = times[4:4 + steps]  # past the prefills, every request decoding
    return {"median_ms": statistics.median(decode) * 1e3, "best_ms": min(decode) * 1e3}


def _run_child(root: str, what: str, kind: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", what, kind,
                          "--rows", str(args.rows), "--reps", str(args.reps),
                          "--steps", str(args.steps), "--threads", str(args.threads)],
                         env=env, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="a checkout from before this work (plain batch only)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "KIND"))
    args = ap.parse_args()
    if args.child:
        import torch
        torch.set_num_threads(args.threads)
        what, kind = args.child
        fn = child_sampler if what == "sampler" else child_engine
        print(json.dumps(fn(kind, args.rows, args.reps if what == "sampler" else args.steps)))
        return
    cases = [("after", HERE, k) for k in ("plain", "penalties", "bias")]
    if args.baseline:
        cases.insert(0, ("before", args.baseline, "plain"))
    for what in ("sampler",) + (() if args.skip_engine else ("engine",)):
        best: dict = {}
        for _ in range(args.rounds):
            for label, root, kind in cases:
                if what == "engine" and kind == "bias":
                    continue
                r = _run_child(root, what, kind, args)
                key = (label, kind)
                best[key] = min(best.get(key, r), r, key=lambda x: x["median_ms"])
        print(f"{what}: {args.rows} rows, {args.threads} thread(s), best of {args.rounds} "
              f"rounds of the median {'sample() call' if what == 'sampler' else 'decode step'}")
        for (label, kind), r in best.items():
            print(f"  {label:6s} {kind:9s} median {r['median_ms']:8.3f} ms  "
                  f"(best single {r['best_ms']:8.3f} ms)")
        base = best.get(("before", "plain"))
        after = best[("after", "plain")]
        if base:
            print(f"  plain batch after / before: {after['median_ms'] / base['median_ms']:.3f}")
        pen = best[("after", "penalties")]
        print(f"  penalized / plain (after): {pen['median_ms'] / after['median_ms']:.3f}")


if __name__ == "__main__":
    main()
