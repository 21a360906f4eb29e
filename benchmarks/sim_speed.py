"""Simulator speed: 100,000 chat-like requests on a 7B-class model over the H100 profile, one
instance, the real Scheduler. Prints wall time and simulated requests per second.

Target: under 60 s on one core. Peer in the same run: the cost of the bare scheduler + runner
loop per generated token is printed so the ratio of simulator overhead is visible.

    python benchmarks/sim_speed.py [--num-requests N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenweir.sim.build import build_simulation  # noqa: E402
from tokenweir.sim.metrics import summarize  # noqa: E402
from tokenweir.sim.workload import synthetic  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--request-rate", type=float, default=30.0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    # Chat-like: ShareGPT-ish medians, heavy right tails.
    specs = synthetic(args.num_requests, args.request_rate, seed=0,
                      prompt="lognormal:256:0.8", output="lognormal:128:0.8",
                      max_model_len=4096)
    sim = build_simulation({"max_num_seqs": 256, "max_num_batched_tokens": 2048}, specs,
                           model_shape="llama-7b", hardware="h100", itl_counts=True)
    profiler = cProfile.Profile() if args.profile else None
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = sim.run()
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    m = summarize(result)
    generated = sum(r.num_output for r in result.requests)
    print(f"requests {m['num_finished']}/{m['num_requests']}  steps {m['num_steps']}  "
          f"generated tokens {generated}")
    print(f"simulated {m['sim_seconds']:.1f} s of serving: {m['request_throughput']:.1f} req/s, "
          f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, TPOT p50 {m['tpot_p50_ms']:.2f} ms, "
          f"preemptions {m['preemptions']}")
    print(f"wall time {wall:.1f} s  ->  {m['num_finished'] / wall:,.0f} simulated requests/s, "
          f"{generated / wall:,.0f} tokens/s, {wall / generated * 1e6:.1f} us per token, "
          f"{wall / m['num_steps'] * 1e3:.2f} ms per step (target: < 60 s)")
    print(f"cpu time {cpu:.1f} s (this process; on a busy machine wall time overstates)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
