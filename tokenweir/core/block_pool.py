"""A fixed pool of KV blocks with reference counts, an O(1) LRU free list and a content map.

Blocks are the integers 0..num_blocks-1, and their state is dense: one list per field
(`ref_cnt`, `generation`, `key`) indexed by block id, and the free list as two link lists over
the same ids. There is no object per block: a block operation touches a few slots of lists
the pool owns instead of a Python object allocated at start and scattered over memory
(issue 36: a 64-instance cluster touches a cold block object on most block operations). The
order of everything (which block is handed out next, which is evicted) is that of the former
one-object-per-block pool, which tests/core/object_block_pool.py keeps as the reference
(tests/core/test_dense_block_pool.py compares them).

The pool knows nothing of requests. Block 0 is the null block: it is never handed out, never
freed, and pads block tables. Every other block is either in the free list (ref_cnt == 0) or
held by at least one owner (ref_cnt > 0); `check_integrity()` proves it.

Prefix caching: a full block can be registered under a `BlockKey`
`(parent_block_id, parent_generation, token_ids)` (the KV cache manager packs the ids:
kv_cache_manager.block_tokens_key). The key names the parent block *and the generation of its
content*, so equal keys mean equal token histories, exactly: a hit is confirmed by comparing
token ids (key equality), never by trusting a hash. A free block keeps
its content and its key until it is handed out again; then its key is dropped and its
generation bumps, so children keyed on its old content can never be reached through it.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

BlockKey = tuple  # (parent_block_id, parent_generation, token ids); parent -1 = root
ROOT_PARENT = (-1, 0)
NULL_BLOCK = 0
NOT_FREE = -1  # `_prev[b]` of a block outside the free list


class BlockPool:
    """Blocks 1..num_blocks-1 are allocatable; block 0 is the null block.

    Per block b: `ref_cnt[b]` (holders; the null block's is 1, for good), `generation[b]`
    (bumps whenever b's content is given up), `key[b]` (its key while it is in the content
    map `cached`, else None). Read them; only the pool writes them. The free list runs from
    `_next[S]` along `_next` back to the sentinel S = num_blocks (`_prev` the other way;
    `_prev[b] == NOT_FREE` for a block outside it): least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.null_block = NULL_BLOCK
        ids = list(range(num_blocks + 1))  # one int object per id, reused by every list
        sentinel = self._sentinel = ids[num_blocks]
        self.ref_cnt: list[int] = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK] = 1  # held forever by the pool itself
        self.generation: list[int] = [0] * num_blocks
        self.key: list[Optional[BlockKey]] = [None] * num_blocks
        # free list 1, 2, ..., num_blocks-1, circular through the sentinel
        self._next: list[int] = [NOT_FREE] + ids[2:] + [ids[1]]
        self._prev: list[int] = [NOT_FREE, sentinel] + ids[1:num_blocks - 1] + [ids[num_blocks - 1]]
        self.num_free_blocks = num_blocks - 1
        self.cached: dict[BlockKey, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def free_ids(self) -> Iterator[int]:
        """The free list, least recently freed first (the next handed out first)."""
        nxt, sentinel = self._next, self._sentinel
        b = nxt[sentinel]
        while b != sentinel:
            yield b
            b = nxt[b]

    def get_new_blocks(self, n: int) -> list[int]:
        """Take n blocks (least recently freed first), each with ref_cnt 1. Caller checks room."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        nxt, prev, keys, gen, ref = self._next, self._prev, self.key, self.generation, \
            self.ref_cnt
        cached, sentinel = self.cached, self._sentinel
        blocks = []
        b = nxt[sentinel]
        for _ in range(n):
            blocks.append(b)
            prev[b] = NOT_FREE
            key = keys[b]
            if key is not None:  # its published content goes (_evict, inlined)
                del cached[key]
                keys[b] = None
            # The generation bumps even for unpublished content (a duplicate of a cached
            # block): it can still be the parent in a published child's key, which handing
            # the block out must orphan.
            gen[b] += 1
            ref[b] = 1
            b = nxt[b]
        nxt[sentinel] = b
        prev[b] = sentinel
        self.num_free_blocks -= n
        return blocks

    def get_new_block(self) -> int:
        """`get_new_blocks(1)[0]`, without the lists: the least recently freed block, ref 1."""
        nxt, sentinel = self._next, self._sentinel
        b = nxt[sentinel]
        if b == sentinel:
            raise ValueError("no free blocks")
        after = nxt[b]
        nxt[sentinel] = after
        self._prev[after] = sentinel
        self._prev[b] = NOT_FREE
        self.num_free_blocks -= 1
        key = self.key[b]
        if key is not None:  # as get_new_blocks
            del self.cached[key]
            self.key[b] = None
        self.generation[b] += 1
        self.ref_cnt[b] = 1
        return b

    # ---- prefix caching ----------------------------------------------------------------
    def lookup(self, key: BlockKey) -> Optional[int]:
        return self.cached.get(key)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference to cache hits; a free one leaves the free list."""
        ref, nxt, prev = self.ref_cnt, self._next, self._prev
        for b in blocks:
            if ref[b] == 0:  # unlink it
                before, after = prev[b], nxt[b]
                nxt[before] = after
                prev[after] = before
                prev[b] = NOT_FREE
                self.num_free_blocks -= 1
            ref[b] += 1

    def register(self, block: int, key: BlockKey) -> None:
        """Publish a held, full block's content. A key already published keeps its block.
        (KVCacheManager's registration loops inline these two lines: change them together.)"""
        if self.key[block] is None and self.cached.setdefault(key, block) == block:  # one hash
            self.key[block] = key

    def _evict(self, block: int) -> None:
        del self.cached[self.key[block]]
        self.key[block] = None
        self.generation[block] += 1

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each; blocks reaching 0 join the free list in the given order
        (so the first given is the first to be reused)."""
        ref, nxt, prev, sentinel = self.ref_cnt, self._next, self._prev, self._sentinel
        last, appended = prev[sentinel], 0
        for b in blocks:
            if ref[b] <= 0 or b == NULL_BLOCK:
                nxt[last] = sentinel  # the blocks linked so far stay freed (as before)
                prev[sentinel] = last
                self.num_free_blocks += appended
                raise ValueError(f"freeing block {b}, which is not held")
            ref[b] -= 1
            if ref[b] == 0:  # appended after `last` (the sentinel is linked at the end)
                nxt[last] = b
                prev[b] = last
                last = b
                appended += 1
        nxt[last] = sentinel
        prev[sentinel] = last
        self.num_free_blocks += appended

    # ---- sharing (forks) ----------------------------------------------------------------
    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of these held blocks (a fork of their holder's table)."""
        ref = self.ref_cnt
        for b in blocks:
            if ref[b] <= 0 or b == NULL_BLOCK:
                raise ValueError(f"sharing block {b}, which is not held")
            ref[b] += 1

    def copy_on_write(self, block: int) -> int:
        """A private block for a holder about to write into `block`, which others still hold
        (ref_cnt > 1): a new block (ref 1) is taken and this holder's reference to `block`
        dropped. The caller copies the content (the pool knows no content). Caller checks
        that a block is free."""
        if self.ref_cnt[block] <= 1:
            raise ValueError(f"copy-on-write of block {block}, which has no other holder")
        [private] = self.get_new_blocks(1)
        self.ref_cnt[block] -= 1
        return private

    def usage(self) -> float:
        """Fraction of allocatable blocks held, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def check_integrity(self) -> None:
        """Every block is exactly one of: null, free (ref 0), or held (ref > 0); the free
        list's links agree both ways."""
        free_ids = list(self.free_ids())
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free list corrupt"
        assert NULL_BLOCK not in free_ids, "null block in the free list"
        chain = [self._sentinel, *free_ids, self._sentinel]
        assert all(self._prev[chain[k + 1]] == chain[k] for k in range(len(chain) - 1)), \
            "free list links disagree"
        assert self.ref_cnt[NULL_BLOCK] == 1, "the null block is not held by the pool"
        for b in range(1, self.num_blocks):
            in_free = self._prev[b] != NOT_FREE
            assert self.ref_cnt[b] >= 0, f"block {b} has a negative ref count"
            assert in_free == (self.ref_cnt[b] == 0), f"block {b} free-list membership wrong"
        for key, b in self.cached.items():
            assert self.key[b] == key, f"block {b} is mapped under a key it does not carry"
