"""Peak RSS of a 64-instance PrefixAwareRouter with every LRU full (capacity 65,536 hashes).

    python benchmarks/router_memory.py tokenweir/sim/router.py   (or any copy of router.py)
"""
import importlib.util, random, resource, sys, time
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("r", path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
router = m.PrefixAwareRouter(64, 16)
rng = random.Random(0)
loads = [0] * 64
groups = [[rng.randrange(1 << 30) for _ in range(128)] for _ in range(256)]
t = time.process_time()
for i in range(300_000):  # 300k prompts of 16-32 blocks: > 64 x 65,536 hashes routed
    tail = [rng.randrange(1 << 30) for _ in range(16 * rng.randint(8, 24))]
    router.choose(groups[i % 256] + tail, loads)
cpu = time.process_time() - t
print(f"{path}: index entries {len(router._holders):,}  LRU sizes {min(router._sizes)}..{max(router._sizes)}  "
      f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB  cpu {cpu:.1f} s")
