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
    full = refreshed = shared = 0
    for _ in range(2500):
        tokens = _prompt(rng)
        loads = [rng.randrange(6) for _ in range(6)]
        chain = router.block_chain(tokens)
        refreshed += any(h in s for s in router._seen for h in chain)
        assert router.choose(tokens, loads) == reference.choose(tokens, loads)
        assert [list(s) for s in router._seen] == reference.seen
        assert router._holders == holders_of(reference.seen)
        full += sum(1 for s in reference.seen if len(s) == 30)
        shared += sum(1 for mask in router._holders.values() if mask & (mask - 1))
    # probes: evictions and moves to the end happened, and hashes held by several instances
    assert full > 1000 and refreshed > 500 and shared > 1000


def holders_of(lrus: list[list[int]]) -> dict[int, int]:
    """The inverted index by definition: hash -> bitmask of the LRUs holding it."""
    index: dict[int, int] = {}
    for i, lru in enumerate(lrus):
        for h in lru:
            index[h] = index.get(h, 0) | 1 << i
    return index


def chain_by_definition(tokens: list[int], block_size: int, max_blocks: int) -> list[int]:
    """Each leading full block's hash, chained: hash((previous hash, the block's tuple))."""
    chain, h = [], 0
    for k in range(min(len(tokens) // block_size, max_blocks)):
        h = hash((h, tuple(tokens[k * block_size:(k + 1) * block_size])))
        chain.append(h)
    return chain


def test_block_chain_is_the_definitions():
    rng = random.Random(5)
    for block_size, max_blocks in ((16, 8), (4, 32), (1, 5), (7, 3)):
        router = PrefixAwareRouter(2, block_size, max_blocks=max_blocks)
        lengths = set()
        for _ in range(300):
            length = rng.randint(0, block_size * (max_blocks + 3))
            tokens = [rng.randrange(3) for _ in range(length)]
            chain = router.block_chain(tokens)
            assert chain == chain_by_definition(tokens, block_size, max_blocks)
            lengths.add(len(chain))
        assert {0, max_blocks} <= lengths  # probe: empty chains and capped ones
