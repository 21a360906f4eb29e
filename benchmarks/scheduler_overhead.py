"""Scheduler overhead: CPU time of schedule() + update_from_output() per running request per step.

N requests (8-token prompts, EOS ignored, max_tokens far beyond the run) are admitted and
stepped until every one is decoding; then `--steps` decode steps are timed. Each step is
schedule() -> a trivial fake runner (one token per scheduled request) -> update_from_output().
schedule() and update_from_output() are timed separately on the thread's CPU clock (this runs on
shared machines; the wall-clock total is printed too); the runner is timed as well but reported
apart and NOT counted, so it can neither hide nor inflate the scheduler's cost.
The block size is 16, so one decode in 16 also allocates a block: block allocation is included.

    python benchmarks/scheduler_overhead.py                    # 256, 1024, 4096 running
    python benchmarks/scheduler_overhead.py --sizes 1024 --steps 200 --profile

Target: <= 5 us per request per step at 1024 running requests (median step, CPU time).
Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenweir.config import SchedulerConfig  # noqa: E402
from tokenweir.core.kv_cache_manager import KVCacheManager, cdiv  # noqa: E402
from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from tokenweir.core.sched.scheduler import Scheduler  # noqa: E402
from tokenweir.request import Request, SamplingParams  # noqa: E402

TARGET_US = 5.0
TARGET_SIZE = 1024
PROMPT_LEN = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096


class TrivialRunner:
    """One token per scheduled request, always: the cheapest runner that keeps the contract
    for decodes (every step reaches the end of what the runner knows)."""

    __slots__ = ()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        tok = [7]
        return ModelRunnerOutput(sampled_token_ids=dict.fromkeys(out.num_scheduled_tokens, tok))


def build(n: int, steps: int) -> Scheduler:
    max_tokens = 8 + 4 * steps  # never finishes during warm-up + timing (+ profiling)
    per_request = cdiv(PROMPT_LEN + max_tokens, BLOCK_SIZE)
    num_blocks = 1 + max(n * per_request, cdiv(MAX_MODEL_LEN, BLOCK_SIZE))
    config = SchedulerConfig(max_num_batched_tokens=max(2 * n, 2048), max_num_seqs=n,
                             max_num_partial_prefills=n, watermark=0.0)
    s = Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE), MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        s.add_request(Request(request_id=f"req-{i}", prompt_token_ids=[11] * PROMPT_LEN,
                              sampling_params=params, max_tokens=max_tokens,
                              arrival_time=float(i), eos_token_ids=frozenset({2})))
    return s


def warm_up(s: Scheduler, runner: TrivialRunner, n: int) -> None:
    """Step until all n requests run and each has sampled a token (is decoding)."""
    for _ in range(100):
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
        if s.num_running == n and not s.waiting and all(
                r.num_tokens - r.num_computed_tokens == 1 for r in s.running):
            return
    raise RuntimeError("warm-up did not reach an all-decoding state")


def timed_steps(s: Scheduler, runner: TrivialRunner, n: int, steps: int) -> dict[str, list]:
    """Per-step seconds of each phase, on the thread's CPU clock (immune to other processes
    taking the CPU on a shared machine) and on the wall clock."""
    t: dict[str, list] = {k: [] for k in ("sched", "run", "upd", "wall")}
    cpu, wall = time.thread_time, time.perf_counter
    for _ in range(steps):
        w0, c0 = wall(), cpu()
        out = s.schedule()
        c1 = cpu()
        result = runner.execute(out)
        c2 = cpu()
        s.update_from_output(out, result)
        c3 = cpu()
        w3 = wall()
        c4 = cpu()  # the cost of reading the clocks themselves, subtracted below
        assert len(out.num_scheduled_tokens) == n, "not every request decoded this step"
        tick = (c4 - c3) / 2
        t["sched"].append(c1 - c0 - tick)
        t["run"].append(c2 - c1 - tick)
        t["upd"].append(c3 - c2 - tick)
        t["wall"].append(w3 - w0 - (t["run"][-1] + tick * 4))
    return t


def measure(n: int, steps: int, profile: bool) -> dict:
    s, runner = build(n, steps), TrivialRunner()
    warm_up(s, runner, n)
    timed_steps(s, runner, n, max(3, steps // 10))  # settle caches and allocator
    gc.collect()
    t = timed_steps(s, runner, n, steps)
    total = [a + b for a, b in zip(t["sched"], t["upd"])]
    us = 1e6 / n
    med = statistics.median
    row = dict(n=n, steps=steps, sched=med(t["sched"]) * us, upd=med(t["upd"]) * us,
               total=med(total) * us, wall=min(t["wall"]) * us, runner=med(t["run"]) * us)
    assert s.stats.num_preemptions == 0
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        timed_steps(s, runner, n, steps)
        prof.disable()
        print(f"\n--- cProfile, {n} running, {steps} steps (runner included) ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--steps", type=int, default=None,
                   help="timed decode steps per size (default: 51200 / size, at least 20)")
    p.add_argument("--profile", action="store_true", help="cProfile one more run per size")
    args = p.parse_args(argv)

    print(f"scheduler overhead: schedule() + update_from_output(), all-decode steps; "
          f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus")
    print("us per request per step: median step, CPU time of this thread; "
          "wall: fastest step, wall clock")
    print(f"{'running':>8} {'steps':>6} {'schedule':>9} {'update':>9} {'total':>9} "
          f"{'wall':>9} {'runner*':>9}")
    rows = []
    for n in args.sizes:
        steps = args.steps or max(20, 51200 // n)
        row = measure(n, steps, args.profile)
        rows.append(row)
        print(f"{n:>8} {steps:>6} {row['sched']:>9.2f} {row['upd']:>9.2f} {row['total']:>9.2f} "
              f"{row['wall']:>9.2f} {row['runner']:>9.2f}", flush=True)
    print("* runner: the trivial fake runner, timed apart and not included in total")
    target = [r for r in rows if r["n"] == TARGET_SIZE]
    if not target:
        return 0
    ok = target[0]["total"] <= TARGET_US
    print(f"target: <= {TARGET_US:.1f} us per request per step at {TARGET_SIZE} running: "
          f"{'PASS' if ok else 'FAIL'} ({target[0]['total']:.2f} us)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
