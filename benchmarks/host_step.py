"""The host side of a decode step, measured on CPU: issue 33's "a decode step must cost
launches, not Python".

    python benchmarks/host_step.py                       # 1, 64 and 512 decodes per step
    python benchmarks/host_step.py --batches 512 --top 30 --profile

A tiny random-weight model of the SmolLM2 family (benchmarks/gpu_throughput.py's --tiny shape:
2 layers, 16-wide heads, a 512-token word vocabulary) makes the forward small, so that what a
step costs beyond it is the host work a GPU step pays too: scheduling, input preparation,
sampling's Python, the scheduler's update and the output fold. Requests are stepped as
LLM.generate steps them (`LLMEngine.step(final_only=True)`), greedy, 64-token prompts.

Per batch size it prints the median over the timed steps of: the wall time per step, the
forward time per step (the model's forward and logits, timed around those calls), and the
host time per request per step, (wall - forward) / decodes. `--profile` adds cProfile's top
functions by own time over the same number of steps (cProfile inflates: read the ranks).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput as gt  # noqa: E402  (the tiny model build)


class ForwardClock:
    """Seconds spent inside the model's forward and logits since the last `take()`."""

    def __init__(self, model) -> None:
        self.spent = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def add_requests(engine, prompts: list[list[int]], max_tokens: int) -> None:
    from tokenweir import SamplingParams
    for prompt in prompts:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request, text = engine.make_request({"prompt_token_ids": prompt}, params)
        engine.add_request(request, text)


def timed_steps(engine, clock: ForwardClock, steps: int) -> list[tuple[float, float]]:
    """(wall, forward) seconds of each of `steps` offline steps."""
    times = []
    for _ in range(steps):
        clock.take()
        t0 = time.perf_counter()
        engine.step(final_only=True)
        times.append((time.perf_counter() - t0, clock.take()))
    return times


def run_case(llm, clock: ForwardClock, prompts: list[list[int]], steps: int, top: int,
             profile: bool) -> list[str]:
    engine = llm.llm_engine
    add_requests(engine, prompts, max_tokens=(3 if profile else 2) * steps + 8)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                   for r in scheduler.running):
        engine.step()  # the prefills, untimed
    timed_steps(engine, clock, 4)  # warm-up
    times = timed_steps(engine, clock, steps)
    n = len(prompts)
    wall = statistics.median(w for w, _ in times)
    forward = statistics.median(f for _, f in times)
    host = statistics.median((w - f) / n for w, f in times)
    lines = [f"{n:4d} decodes per step: wall {wall * 1e3:8.3f} ms, forward {forward * 1e3:7.3f} "
             f"ms, host {host * 1e6:7.2f} us per request (medians of {steps} steps)"]
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        timed_steps(engine, clock, steps)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        lines.append(f"host functions by own time (cProfile, {steps} steps):")
        lines += [ln for ln in text.getvalue().splitlines() if ln.strip()][4:]
    engine.abort_requests([r.request_id for r in list(scheduler.running)])
    while engine.has_unfinished_requests():
        engine.step()
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,512", help="decodes per step, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--profile", action="store_true", help="cProfile table per batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    import torch
    from tokenweir import LLM
    torch.set_num_threads(args.threads)
    plan = gt.plans(tiny=True)[0]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="tw-host-") as folder:
        info = gt.build_model(plan, folder, "cpu", torch.float32, True)
        llm = LLM(model=folder, device="cpu", dtype="float32", seed=0, max_model_len=1024,
                  max_num_seqs=max(batches), max_num_batched_tokens=8192,
                  kv_cache_space=0.25)
        clock = ForwardClock(llm.llm_engine.core.executor.model)
        print(f"{plan.name} tiny ({info['layers']} layers, hidden {info['hidden']}, vocab "
              f"{info['vocab']}), float32 on cpu, {args.threads} torch thread(s)", flush=True)
        prompts = plan.workloads[0].prompts(info["vocab"])
        for batch in batches:
            group = [(pr * 64)[:64] for pr in (prompts * batch)[:batch]]
            print("\n".join(run_case(llm, clock, group, args.steps, args.top, args.profile)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
