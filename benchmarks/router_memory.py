"""Peak RSS of a 64-instance PrefixAwareRouter whose every LRU is full (65,536 hashes each).

Routes 300,000 prompts (256 shared 128-token prefixes, then 128-384 random tokens: 16-32 full
blocks each) with equal loads, then prints the index's size, the LRUs' sizes, the process's
peak RSS and the CPU time the routing took. Give the router module to load, so an old copy of
router.py can be measured against the current one:

    python benchmarks/router_memory.py tokenweir/routing/prefix_aware.py
"""

from __future__ import annotations

import importlib.util
import random
import resource
import sys
import time


def load_router_module(path: str):
    spec = importlib.util.spec_from_file_location("router_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else "tokenweir/routing/prefix_aware.py"
    router = load_router_module(path).PrefixAwareRouter(64, 16)
    rng = random.Random(0)
    loads = [0] * 64
    prefixes = [[rng.randrange(1 << 30) for _ in range(128)] for _ in range(256)]
    started = time.process_time()
    for i in range(300_000):  # > 64 x 65,536 hashes routed: every LRU fills and evicts
        tail = [rng.randrange(1 << 30) for _ in range(16 * rng.randint(8, 24))]
        router.choose(prefixes[i % 256] + tail, loads)
    cpu = time.process_time() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{path}: index entries {len(router._holders):,}  LRU sizes "
          f"{min(router._sizes)}..{max(router._sizes)}  peak RSS {peak_mib:.0f} MiB  "
          f"cpu {cpu:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
