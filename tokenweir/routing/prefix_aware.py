"""prefix-aware: the instance whose recently routed prompts share the longest run of leading
full blocks with this prompt (an approximate, router-side view of each prefix cache, as
SGLang's cache-aware router keeps); ties go to the less loaded. With no match, the least
loaded instance, ties to the one that has seen the fewest blocks (new prefixes spread out
instead of piling onto instance 0). Affinity yields to balance when the matched instance
holds more than `balance_slack` requests above the least loaded one. An unavailable instance
(load UNAVAILABLE, base.py) is never chosen: its load exceeds any slack, and the fallback is
the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

from tokenweir.routing.base import RoutingPolicy


class PrefixAwareRouter(RoutingPolicy):
    """See the module docstring. Besides each instance's LRU of block hashes, an inverted
    index (hash -> instances that hold it) finds the instances matching a chain without
    visiting the others: a choice costs O(chain + matching instances), plus one C-level pass
    for the least-loaded fallback, instead of n chain walks (a 64-instance cluster routes a
    million requests). Decisions are exactly those of the plain definition (`match_len` for
    every instance, then max/min over the instances as written in `choose`).

    The index maps a hash to a bitmask of instances (bit i: instance i holds it): an int
    costs a fraction of a set's memory (at 64 instances with full LRUs the index holds
    millions of hashes), and narrowing the matching instances is one `&` per block."""

    def __init__(self, num_instances: int, block_size: int = 16, max_blocks: int = 32,
                 capacity: int = 1 << 16, balance_slack: int = 16) -> None:
        super().__init__(num_instances, block_size)
        self.max_blocks = max_blocks
        self.capacity, self.balance_slack = capacity, balance_slack
        # per instance: chained hashes of routed prompts' leading blocks, oldest first (LRU;
        # an OrderedDict: the oldest leaves in O(1), `popitem(last=False)`, where a dict's
        # iteration walks the dead slots its deletions leave in front)
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_instances)]
        self._holders: dict[int, int] = {}  # hash -> bitmask: instances whose _seen holds it
        self._sizes = [0] * num_instances  # len(self._seen[i]), for the fallback's key
        # 1 << i, one int object per instance: the mask of a hash only instance i holds (most
        # of the index: a prompt's blocks after its shared prefix) refers to it, not to an
        # int object of its own (~4M of them, 32 bytes each, in a 1M-request cluster run)
        self._bits = [1 << i for i in range(num_instances)]

    def block_chain(self, tokens: list[int]) -> list[int]:
        """Hashes of the leading full blocks, each covering every token before it. Python
        hashes of int tuples are not salted, so the chain is the same in every run."""
        bs = self.block_size
        n = min(len(tokens) // bs, self.max_blocks)
        chain, h = [], 0
        # zip over one iterator `bs` times: the blocks' tuples, made in C in one pass over
        # the head's slice (no tuple of the head, no slice per block; the same tuples, so
        # the same hashes)
        for block in zip(*[iter(tokens[:n * bs])] * bs):
            h = hash((h, block))
            chain.append(h)
        return chain

    def match_len(self, instance: int, chain: list[int]) -> int:
        seen = self._seen[instance]
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        return n

    def longest_matches(self, chain: list[int]) -> tuple[int, list[int]]:
        """(the longest match_len over the instances, the instances that reach it, lowest
        first); (0, []) when none holds the chain's first block."""
        holders = self._holders
        alive = holders.get(chain[0], 0) if chain else 0
        if not alive:
            return 0, []
        n = 1
        while n < len(chain):
            nxt = alive & holders.get(chain[n], 0)
            if not nxt:
                break
            alive, n = nxt, n + 1
        return n, instances_in(alive)

    def choose(self, tokens: list[int], loads: Sequence[float],
               session: Optional[Hashable] = None) -> int:
        chain = self.block_chain(tokens)
        longest, matched = self.longest_matches(chain)
        fallback = self._fallback(loads)
        if longest == 0:
            best = fallback
        else:  # the longest match; ties to the less loaded, then the lower index
            best = min(matched, key=lambda i: (loads[i], i))
            if loads[best] > loads[fallback] + self.balance_slack:
                best = fallback
        self._remember(best, chain)
        return best

    def _fallback(self, loads: Sequence[float]) -> int:
        """min over (load, blocks seen, index): the least loaded, ties to the fewest blocks
        seen, then the lower index. C-level passes: min and count, then one `index` per
        instance tied at the least load (the common case is one)."""
        least = min(loads)
        best, tied = loads.index(least), loads.count(least)
        sizes, i = self._sizes, best
        for _ in range(tied - 1):  # the other instances tied at the least load, lowest first
            i = loads.index(least, i + 1)
            if sizes[i] < sizes[best]:
                best = i
        return best

    def _remember(self, instance: int, chain: list[int]) -> None:
        """`chain` becomes the most recently routed to `instance`; the LRU then drops its
        oldest hashes beyond `capacity`, oldest first."""
        seen, holders, bit = self._seen[instance], self._holders, self._bits[instance]
        move_to_end = seen.move_to_end
        setdefault = holders.setdefault
        for h in chain:
            if h in seen:
                move_to_end(h)
            else:
                seen[h] = None
                # a hash new to the index takes `bit` in one probe; a held one adds it
                holding = setdefault(h, bit)
                if holding is not bit:  # (bit is not in it: h was not in `seen`)
                    holders[h] = holding | bit
        excess = len(seen) - self.capacity
        if excess > 0:
            pop_oldest = seen.popitem
            for _ in range(excess):
                oldest = pop_oldest(last=False)[0]
                holding = holders[oldest] & ~bit
                if holding:  # one holder left: its shared bit (self._bits)
                    holders[oldest] = holding if holding & (holding - 1) else \
                        self._bits[holding.bit_length() - 1]
                else:
                    del holders[oldest]
        self._sizes[instance] = len(seen)


def instances_in(mask: int) -> list[int]:
    """The set bits of `mask`, lowest first: the instances a holders bitmask names."""
    found = []
    while mask:
        low = mask & -mask
        found.append(low.bit_length() - 1)
        mask ^= low
    return found

