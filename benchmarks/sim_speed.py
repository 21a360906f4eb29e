"""Simulator speed, on one core, with the real Scheduler.

Default: 100,000 chat-like requests on a 7B-class model over the H100 profile, one instance
(target: under 60 s). `--cluster`: 1,000,000 requests on 64 instances behind the prefix-aware
router (target: under 3 minutes, issue 36), the same chat-like lengths plus prefix groups (system
prompts shared by many requests), arrivals at 30 req/s per instance (the single instance's
load).

Prints wall time AND process CPU time (on a busy machine wall time overstates), simulated
requests per second, the cost per generated token, and a digest of everything the run decided
(two runs of the same inputs print the same digest).

    python benchmarks/sim_speed.py [--num-requests N] [--profile] [--huge-pages]
    python benchmarks/sim_speed.py --cluster [--num-requests N] [--num-instances N] [--profile]
                                   [--no-huge-pages]

Huge pages (the default for `--cluster` where the machine offers them: glibc >= 2.35 and the
kernel's transparent huge pages in mode "madvise" or "always"; `--no-huge-pages` turns them
off, `--huge-pages` on for the single instance too, where they were not timed): the
simulation runs in a process whose Python objects come from glibc malloc (PYTHONMALLOC=malloc)
backed by transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1): the script
re-executes itself with those two variables. It changes no decision (same digest), only where
the objects live: a 64-instance cluster's objects (blocks, prefix-cache keys, router LRUs:
~200 MB at 20k requests, ~575 MB at 100k) span more 4 KiB pages than the TLB holds, and most
block operations touch a block freed thousands of operations earlier. Measured (exclusive,
taskset -c 0, 3 interleaved pairs): simrun9 on an AMD EPYC, 20k cluster: 13.3 / 11.6 / 12.3 s
plain, 11.7 / 11.1 / 11.0 s with them; sim11 on an Intel Xeon (AVX-512, AMX), 100k cluster:
38.2 / 39.6 / 36.8 s plain, 34.3 / 34.8 / 33.0 s with them (digest b31c8d01 both).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenweir.sim.build import build_simulation  # noqa: E402
from tokenweir.sim.cluster import build_cluster, summarize_cluster  # noqa: E402
from tokenweir.sim.digest import cluster_digest, instance_digest  # noqa: E402
from tokenweir.sim.metrics import summarize  # noqa: E402
from tokenweir.sim.workload import synthetic  # noqa: E402

ENGINE_ARGS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
HUGE_PAGES_ENV = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def in_huge_pages() -> bool:
    """This process was started with HUGE_PAGES_ENV (they act only from a process's start)."""
    return all(os.environ.get(k) == v for k, v in HUGE_PAGES_ENV.items())


def anon_huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, KiB (-1: not readable)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def huge_pages_offered() -> bool:
    """glibc >= 2.35 (its malloc.hugetlb tunable) and transparent huge pages the kernel gives
    on madvise or always: what `--huge-pages` needs to do anything."""
    name, version = platform.libc_ver()
    try:
        glibc_ok = name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)
        mode = Path(THP_MODE).read_text().split("[")[1].split("]")[0]
    except (OSError, ValueError, IndexError):
        return False
    return glibc_ok and mode in ("madvise", "always")


def reexec_in_huge_pages() -> None:
    """Replace this process by the same command with HUGE_PAGES_ENV set (see the docstring)."""
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HUGE_PAGES_ENV})


def chat_workload(num_requests: int, rate: float, prefix_groups: int = 0,
                  prefix_len: int = 0) -> list:
    """Chat-like: ShareGPT-ish medians, heavy right tails."""
    return synthetic(num_requests, rate, seed=0, prompt="lognormal:256:0.8",
                     output="lognormal:128:0.8", max_model_len=4096,
                     num_prefix_groups=prefix_groups, prefix_len=prefix_len)


def run_single(args: argparse.Namespace):
    specs = chat_workload(args.num_requests, args.request_rate or 30.0)
    sim = build_simulation(ENGINE_ARGS, specs, model_shape="llama-7b", hardware="h100",
                           itl_counts=True)
    return sim.run, lambda result: (summarize(result), result.requests,
                                    instance_digest(result))


def run_cluster(args: argparse.Namespace):
    rate = args.request_rate or 30.0 * args.num_instances
    specs = chat_workload(args.num_requests, rate, prefix_groups=args.prefix_groups,
                          prefix_len=args.prefix_len)
    sim = build_cluster(ENGINE_ARGS, specs, model_shape="llama-7b", hardware="h100",
                        num_instances=args.num_instances, router="prefix-aware",
                        record_steps=False, itl_counts=True)
    return sim.run, lambda result: (summarize_cluster(result)["overall"],
                                    result.overall.requests, cluster_digest(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", action="store_true", help="64 instances, 1M requests")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--num-instances", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="req/s (default: 30, per instance in a cluster)")
    parser.add_argument("--prefix-groups", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                        help="Python objects in glibc malloc on transparent huge pages "
                             "(re-executes with PYTHONMALLOC=malloc and glibc.malloc.hugetlb=1); "
                             "default: on for --cluster where the machine offers them")
    args = parser.parse_args()
    huge = (args.cluster and huge_pages_offered()) if args.huge_pages is None \
        else args.huge_pages
    if huge and not in_huge_pages():
        reexec_in_huge_pages()
    if args.num_requests is None:
        args.num_requests = 1_000_000 if args.cluster else 100_000
    target = 180 if args.cluster else 60
    setup_started = time.process_time()
    run, report = (run_cluster if args.cluster else run_single)(args)
    setup_cpu = time.process_time() - setup_started
    profiler = cProfile.Profile() if args.profile else None
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = run()
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    m, records, digest = report(result)
    generated = sum(r.num_output for r in records)
    where = f"{args.num_instances} instances, prefix-aware" if args.cluster else "1 instance"
    print(f"{where}: requests {m['num_finished']}/{m['num_requests']}  steps {m['num_steps']}  "
          f"generated tokens {generated}")
    print(f"simulated {m['sim_seconds']:.1f} s of serving: {m['request_throughput']:.1f} req/s, "
          f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, TPOT p50 {m['tpot_p50_ms']:.2f} ms, "
          f"preemptions {m['preemptions']}, prefix hit rate {m.get('prefix_hit_rate', 0):.3f}")
    print(f"wall time {wall:.1f} s  ->  {m['num_finished'] / wall:,.0f} simulated requests/s, "
          f"{generated / wall:,.0f} tokens/s, {wall / generated * 1e6:.2f} us per token, "
          f"{wall / max(1, m['num_steps']) * 1e3:.3f} ms per step (target: < {target} s)")
    print(f"cpu time {cpu:.1f} s (this process; workload setup {setup_cpu:.1f} s more), "
          f"{cpu / generated * 1e6:.2f} us per token")
    print("objects: " + ("glibc malloc on transparent huge pages" if in_huge_pages()
                         else "pymalloc")
          + f", AnonHugePages {anon_huge_kib()} kB")
    if digest:
        print(f"digest {digest}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
