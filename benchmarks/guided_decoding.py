"""What guided decoding costs a batch: decode step time with 0, 1 and 8 guided requests out of 8.

(Issue 15 asks for this in benchmarks/parallel_sampling.py; that file was not on main when this
was written, so it lives here.)

Eight requests decode together for `--tokens` steps after their prefill. Unguided requests run
with ignore_eos; guided ones follow a JSON schema whose one string field must be at least 2,000
characters long, so it cannot close within the run, so every request decodes every step and the batches compare like with
like (the masks are those of text inside a JSON string: most of the vocabulary allowed, the
costly case for the mask fill and for applying it). For each configuration: the median decode
step time, its ratio to the unguided batch measured in the same run, the worker thread's mask
fill time per step, and how much of it the stepping thread still waited for (the part the
forward pass did not hide).

Timings are indicative: the machine is shared and noisy; only ratios from one run mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenweir import SamplingParams  # noqa: E402
from tokenweir.config import EngineConfig  # noqa: E402
from tokenweir.engine.llm_engine import LLMEngine  # noqa: E402
from tokenweir.model.loader import load_model  # noqa: E402
from tokenweir.request import GuidedDecodingParams  # noqa: E402

BATCH = 8
LONG_STRING = {"type": "object",
               "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
               "required": ["story"], "additionalProperties": False}
PROMPTS = ["Tell me a long story about a river.", "Describe the city of Lisbon in detail.",
           "Write a letter to a friend about the weather.", "Explain how a weir works.",
           "List the planets and say something about each.", "Write a poem about bread.",
           "What happened in the year 1500?", "Describe your favourite walk."]


def params(guided: bool, tokens: int, seed: int) -> SamplingParams:
    if guided:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=tokens,
                              guided_decoding=GuidedDecodingParams(json=LONG_STRING))
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=tokens, ignore_eos=True)


def run(engine: LLMEngine, num_guided: int, tokens: int) -> dict:
    """Median decode step time (seconds) and mask fill / wait seconds per decode step."""
    for i in range(BATCH):
        request, text = engine.make_request(PROMPTS[i], params(i < num_guided, tokens, i))
        engine.add_request(request, text)
    guided = engine.guided
    step_times, fill, wait, steps = [], 0.0, 0.0, 0
    finished_lengths = []
    while engine.has_unfinished_requests():
        fill0, wait0 = guided.fill_seconds, guided.wait_seconds
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        finished_lengths += [len(o.outputs[0].token_ids) for o in outputs if o.finished]
        if engine.scheduler.stats.last_iteration_tokens == BATCH:
            step_times.append(elapsed)  # a pure decode step: one token for each of the 8
            fill += guided.fill_seconds - fill0
            wait += guided.wait_seconds - wait0
        steps += 1
    assert finished_lengths == [tokens] * BATCH, \
        f"every request must decode {tokens} tokens, got {finished_lengths} ({num_guided} guided)"
    n = len(step_times)
    return {"median": statistics.median(step_times), "fill": fill / n, "wait": wait / n,
            "steps": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens each request decodes")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", torch.float32, torch.device("cpu"))
    config = EngineConfig.from_kwargs(model="smollm2-135m", dtype="float32", max_model_len=1024,
                                      kv_cache_space=0.25, seed=0)
    engine = LLMEngine(config, loaded=loaded)
    run(engine, BATCH, 4)  # warm-up: kernels, llguidance's tokenizer, the grammar cache
    print(f"decode steps of a batch of {BATCH}, {args.tokens} tokens each, float32, "
          f"{torch.get_num_threads()} torch threads; best of {args.repeats}")
    results = {}
    for num_guided in (0, 1, BATCH):
        runs = [run(engine, num_guided, args.tokens) for _ in range(args.repeats)]
        results[num_guided] = min(runs, key=lambda r: r["median"])
    base = results[0]["median"]
    print(f"{'guided':>6} {'step ms':>8} {'x unguided':>10} {'fill ms/step':>12} "
          f"{'waited ms/step':>14}")
    for num_guided, r in results.items():
        print(f"{num_guided:>6} {r['median'] * 1e3:>8.2f} {r['median'] / base:>10.3f} "
              f"{r['fill'] * 1e3:>12.2f} {r['wait'] * 1e3:>14.2f}")
    engine.close()


if __name__ == "__main__":
    main()
