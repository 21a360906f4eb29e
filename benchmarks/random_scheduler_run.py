"""The seeded random scheduler run of tests/core/test_random_at_scale.py, at 1,000,000 steps:
every feature on at once (chunked prefill, prefix caching, swap and auto preemption, cost
victims, the slo policy's pauses and mid-step cuts, aborts), invariants checked after every
step (tests/core/random_run.py). Prints a line per segment, then steps/s and the invariant
checks done. Exit status 1 (an AssertionError) on any broken invariant.

    python benchmarks/random_scheduler_run.py                  # 1,000,000 steps
    python benchmarks/random_scheduler_run.py --steps 200000 --seed 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.core.random_run import RunStats, random_run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-per-segment", type=int, default=25_000)
    args = p.parse_args(argv)
    start, cpu_start = time.perf_counter(), time.process_time()

    def progress(stats: RunStats) -> None:
        elapsed = time.perf_counter() - start
        print(f"{stats.steps:>9} steps  {stats.steps / elapsed:8.0f} steps/s  "
              f"{stats.invariant_checks:>11} checks  {stats.requests:>7} requests", flush=True)

    stats = random_run(args.steps, seed=args.seed, steps_per_segment=args.steps_per_segment,
                       progress=progress)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"steps: {stats.steps}  wall {wall:.1f} s ({stats.steps / wall:.0f} steps/s), "
          f"CPU {cpu:.1f} s ({stats.steps / cpu:.0f} steps/s)")
    print(f"invariant checks: {stats.invariant_checks} (full integrity passes "
          f"{stats.integrity_checks}, per-request {stats.request_checks}, KV positions "
          f"{stats.kv_positions_checked})")
    print(f"requests {stats.requests}: finished {stats.finished}, aborted {stats.aborted}; "
          f"cuts {stats.cuts}, re-admitted in their preemption step {stats.readmitted_in_step}")
    print("counters: " + ", ".join(f"{k} {v}" for k, v in stats.counters.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
