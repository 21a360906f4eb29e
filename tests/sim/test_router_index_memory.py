"""The prefix-aware router's inverted index (hash -> bitmask of the instances holding it) refers
to one shared int per instance for a hash only that instance holds (most of the index: the
blocks after a prompt's shared prefix), not to an int object of its own: ~4M fewer objects in
a 1M-request, 64-instance run. Decisions are the plain definition's either way
(test_sim_scale.test_the_indexed_router_decides_as_the_plain_one)."""

from __future__ import annotations

import random

from tokenweir.routing.prefix_aware import PrefixAwareRouter


def _prompt(rng: random.Random) -> list[int]:
    shared = [1000 + rng.randrange(6)] * (16 * rng.randint(0, 3))
    return shared + [rng.randrange(10**6) for _ in range(rng.randint(16, 80))]


def test_a_hash_one_instance_holds_maps_to_that_instances_shared_bit():
    rng = random.Random(3)
    router = PrefixAwareRouter(16, 16, max_blocks=8, capacity=40, balance_slack=1)
    for _ in range(600):
        router.choose(_prompt(rng), [rng.randrange(5) for _ in range(16)])
    single = {h: mask for h, mask in router._holders.items() if mask & (mask - 1) == 0}
    # probe: single holders past the small ints CPython shares anyway (1 << 9 > 256), and
    # shared hashes (several holders) in the index too
    assert sum(1 for mask in single.values() if mask >= 1 << 9) > 50
    assert len(single) < len(router._holders)
    assert all(mask is router._bits[mask.bit_length() - 1] for mask in single.values())
