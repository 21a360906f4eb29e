"""Scale: the cluster benchmark's run is a pure function of its inputs (a small version run
twice gives the same digest), and the fast paths added for it decide exactly what the plain
definitions decide (the prefix-aware router's inverted index)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from tokenweir.sim.cluster import build_cluster
from tokenweir.sim.digest import cluster_digest
from tokenweir.routing.prefix_aware import PrefixAwareRouter, instances_in
from tokenweir.sim.workload import synthetic

ROOT = Path(__file__).resolve().parents[2]


class PlainPrefixAwareRouter(PrefixAwareRouter):
    """The router as first written (every instance's chain walked, max/min over all)."""

    def choose(self, tokens, loads):
        chain = self.block_chain(tokens)
        n = self.num_instances
        matches = [self.match_len(i, chain) for i in range(n)]
        best = max(range(n), key=lambda i: (matches[i], -loads[i], -i))
        fallback = min(range(n), key=lambda i: (loads[i], len(self._seen[i]), i))
        if matches[best] == 0 or loads[best] > loads[fallback] + self.balance_slack:
            best = fallback
        self._remember(best, chain)
        return best


def _prompt(rng: random.Random) -> list[int]:
    group = rng.randrange(12)
    shared = [1000 + group] * (16 * rng.randint(0, 6)) + [group] * rng.randint(0, 20)
    return shared + [rng.randrange(10**6) for _ in range(rng.randint(0, 40))]


def test_the_indexed_router_decides_as_the_plain_one():
    rng = random.Random(5)
    fast = PrefixAwareRouter(7, 16, max_blocks=8, capacity=24, balance_slack=3)
    plain = PlainPrefixAwareRouter(7, 16, max_blocks=8, capacity=24, balance_slack=3)
    choices, evicted = [], 0
    for _ in range(3000):
        tokens = _prompt(rng)
        loads = [rng.randrange(12) for _ in range(7)]
        a, b = fast.choose(tokens, loads), plain.choose(tokens, loads)
        assert a == b
        choices.append(a)
        evicted += sum(1 for s in fast._seen if len(s) == fast.capacity)
    assert len(set(choices)) == 7  # every instance was chosen
    assert evicted > 0  # the probe: the LRU really evicted (small capacity)
    # the index is the exact inverse of the per-instance LRUs
    inverse: dict[int, int] = {}  # hash -> bitmask of the instances holding it
    for i, seen in enumerate(fast._seen):
        for h in seen:
            inverse[h] = inverse.get(h, 0) | (1 << i)
    assert inverse == fast._holders
    assert any(bin(mask).count("1") > 1 for mask in inverse.values())  # shared hashes exist
    assert fast._sizes == [len(s) for s in fast._seen]


def test_chain_and_fallback_are_their_definitions():
    """block_chain (slices of one head tuple) hashes what the definition hashes; _fallback
    (tied instances found by `index`) is min over (load, blocks seen, index)."""
    rng = random.Random(9)
    router = PrefixAwareRouter(9, 16, max_blocks=8, capacity=40)
    ties = 0
    for _ in range(2000):
        tokens = _prompt(rng)
        chain, h = [], 0
        for k in range(min(len(tokens) // 16, 8)):
            h = hash((h, tuple(tokens[k * 16:(k + 1) * 16])))
            chain.append(h)
        assert router.block_chain(tokens) == chain
        loads = [rng.randrange(4) for _ in range(9)]
        plain = min(range(9), key=lambda i: (loads[i], len(router._seen[i]), i))
        assert router._fallback(loads) == plain
        ties += loads.count(min(loads)) > 1 and len({router._sizes[i] for i in range(9)
                                                      if loads[i] == min(loads)}) > 1
        router.choose(tokens, loads)
    assert ties > 100  # probe: ties at the least load, broken by blocks seen, were common


class OneAtATimeLRURouter(PrefixAwareRouter):
    """The LRU as first written: plain dicts, each eviction finds the oldest hash with
    next(iter(...))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._seen = [{} for _ in range(self.num_instances)]

    def _remember(self, instance, chain):
        seen, holders, bit = self._seen[instance], self._holders, 1 << instance
        for h in chain:
            if h not in seen:
                holders[h] = holders.get(h, 0) | bit
            seen.pop(h, None)
            seen[h] = None
        while len(seen) > self.capacity:
            oldest = next(iter(seen))
            del seen[oldest]
            holding = holders[oldest] & ~bit
            if holding:
                holders[oldest] = holding
            else:
                del holders[oldest]
        self._sizes[instance] = len(seen)


def test_the_ordered_lru_keeps_what_one_at_a_time_eviction_keeps():
    """The router's LRUs (OrderedDicts, the oldest popped in O(1)) hold what plain dicts
    evicting one oldest at a time hold, in the same order; the index and sizes agree."""
    rng = random.Random(11)
    fast = PrefixAwareRouter(5, 16, max_blocks=8, capacity=30, balance_slack=3)
    plain = OneAtATimeLRURouter(5, 16, max_blocks=8, capacity=30, balance_slack=3)
    for _ in range(3000):
        tokens = _prompt(rng)
        loads = [rng.randrange(12) for _ in range(5)]
        assert fast.choose(tokens, loads) == plain.choose(tokens, loads)
        assert [list(s) for s in fast._seen] == [list(s) for s in plain._seen]  # LRU order
    assert fast._holders == plain._holders
    assert fast._sizes == plain._sizes
    assert all(len(s) == fast.capacity for s in fast._seen)  # the probe: full, evicting


def test_instances_in_lists_a_masks_bits_lowest_first():
    assert instances_in(0) == []
    assert instances_in(1) == [0]
    assert instances_in((1 << 63) | (1 << 5) | 1) == [0, 5, 63]
    rng = random.Random(3)
    for _ in range(200):
        members = sorted(rng.sample(range(64), rng.randint(0, 64)))
        assert instances_in(sum(1 << i for i in members)) == members


def _small_cluster_digest(stretches: bool = True) -> tuple[str, int]:
    """`stretches` False: every instance takes the general per-step path (no decode
    stretches, sim/decode_stretch.py)."""
    specs = synthetic(600, 400.0, seed=1, prompt="lognormal:256:0.8",
                      output="lognormal:64:0.8", max_model_len=4096,
                      num_prefix_groups=16, prefix_len=128)
    sim = build_cluster({"max_num_seqs": 64, "max_num_batched_tokens": 1024,
                         "num_gpu_blocks_override": 400}, specs, num_instances=8,
                        router="prefix-aware", record_steps=False, itl_counts=True)
    if not stretches:
        for inst in sim.instances:
            inst.stretch = None
    result = sim.run()
    return cluster_digest(result), result.overall.stats.num_preemptions


def test_a_small_cluster_run_twice_gives_the_same_digest():
    first, preemptions = _small_cluster_digest()
    second, _ = _small_cluster_digest()
    assert first == second
    assert preemptions > 0  # the probe: the cramped pools really preempted


def test_the_digest_changes_when_a_decision_changes():
    """Two routers route the same requests differently: two digests. The pools hold 4096
    blocks each, room for every request an instance gets (20 of at most 64 blocks), so
    nothing is preempted: the model's default pool (1 GiB of KV: ~209k blocks per instance)
    took ~90% of this test's time to build and decided the same."""
    specs = synthetic(60, 100.0, seed=2, max_model_len=1024)
    digests, routed = set(), set()
    for router in ("round-robin", "least-loaded"):
        result = build_cluster({"num_gpu_blocks_override": 4096}, specs, "smollm2-135m",
                               num_instances=3, router=router).run()
        assert result.overall.stats.num_preemptions == 0
        digests.add(cluster_digest(result))
        routed.add(repr([sorted(r.request_id for r in inst.requests)
                         for inst in result.instances]))
    assert len(routed) == 2  # the probe: the routers did send requests elsewhere
    assert len(digests) == 2


def test_the_cluster_benchmark_prints_a_digest_that_repeats():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_speed.py"), "--cluster",
           "--num-requests", "400", "--num-instances", "4"]
    digests = []
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
        assert "requests 400/400" in out and "cpu time" in out
        digests.append(next(line for line in out.splitlines() if line.startswith("digest")))
    assert digests[0] == digests[1]
