"""The prefix-aware router's per-instance LRUs (PrefixAwareRouter._seen) hold exactly what the
definition says, in its order: routing a chain to an instance makes each of its hashes, in
chain order, the most recent there (appended, or moved to the end), then the oldest beyond
`capacity` leave. A reference kept as plain lists, with the plain definition's choice, routes
the same prompts beside the router: the same choices, and the same LRU contents and order after
every choice. (test_sim_scale compares the router with a plain chooser that shares its
`_remember`; this holds `_remember` itself.)"""

from __future__ import annotations

import random

from tokenweir.routing.prefix_aware import PrefixAwareRouter


class ListLRURouter:
    """The definition, with each LRU a list (oldest first)."""

    def __init__(self, n: int, capacity: int, balance_slack: int, chain_of) -> None:
        self.n, self.capacity, self.slack, self.chain_of = n, capacity, balance_slack, chain_of
        self.seen: list[list[int]] = [[] for _ in range(n)]

    def choose(self, tokens: list[int], loads: list[int]) -> int:
        chain, n = self.chain_of(tokens), self.n

        def match(i: int) -> int:
            k = 0
            while k < len(chain) and chain[k] in self.seen[i]:
                k += 1
            return k
        matches = [match(i) for i in range(n)]
        best = max(range(n), key=lambda i: (matches[i], -loads[i], -i))
        fallback = min(range(n), key=lambda i: (loads[i], len(self.seen[i]), i))
        if matches[best] == 0 or loads[best] > loads[fallback] + self.slack:
            best = fallback
        lru = self.seen[best]
        for h in chain:
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[:max(0, len(lru) - self.capacity)]
        return best


def _prompt(rng: random.Random) -> list[int]:
    group = rng.randrange(8)
    shared = [1000 + group] * (16 * rng.randint(0, 5))
    return shared + [rng.randrange(10**6) for _ in range(rng.randint(0, 60))]


def test_the_lrus_hold_the_definitions_hashes_in_its_order():
    rng = random.Random(11)
    router = PrefixAwareRouter(6, 16, max_blocks=8, capacity=30, balance_slack=2)
    reference = ListLRURouter(6, 30, 2, router.block_chain)
    full = refreshed = 0
    for _ in range(2500):
        tokens = _prompt(rng)
        loads = [rng.randrange(6) for _ in range(6)]
        chain = router.block_chain(tokens)
        refreshed += any(h in s for s in router._seen for h in chain)
        assert router.choose(tokens, loads) == reference.choose(tokens, loads)
        assert [list(s) for s in router._seen] == reference.seen
        full += sum(1 for s in reference.seen if len(s) == 30)
    assert full > 1000 and refreshed > 500  # probes: evictions and moves to the end happened
