"""A fixed pool of KV blocks with reference counts, an O(1) LRU free list and a content map.

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

One object per block, on purpose (issue 36, simkv12): a dense layout (per-block lists of ref
counts, generations, keys and free-list links over int ids, same block ids and digests) ran
the 100k x 64 cluster slower in 3 of 3 interleaved exclusive pairs (31.4 / 31.9 / 37.4 s
against 29.7 / 30.1 / 29.2 s): in CPython an index per field costs more than the slot loads
of one cold object. The branch simkv12 (commit 7956e95) holds it.
"""

from __future__ import annotations

from typing import Iterable, Optional

BlockKey = tuple  # (parent_block_id, parent_generation, token ids); parent -1 = root
ROOT_PARENT = (-1, 0)


class KVBlock:
    """One block of `block_size` token slots. Doubly linked while it sits in the free list."""

    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free", "key", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: Optional[KVBlock] = None
        self.next_free: Optional[KVBlock] = None
        self.key: Optional[BlockKey] = None  # set while the block is in the content map
        self.generation = 0  # bumps whenever the block's content is given up

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop the least recently freed, append, remove any, O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """The n least recently freed blocks, unlinked (one pass; caller checks n <= free)."""
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            if block is None or block is self._tail:
                raise ValueError("no free blocks")
            blocks.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Blocks 1..num_blocks-1 are allocatable; block 0 is the null block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever by the pool itself
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockKey, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks (least recently freed first), each with ref_cnt 1. Caller checks room."""
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached
        for block in blocks:
            if block.key is not None:  # its published content goes (_evict, inlined)
                del cached[block.key]
                block.key = None
            # The generation bumps even for unpublished content (a duplicate of a cached
            # block): it can still be the parent in a published child's key, which handing
            # the block out must orphan.
            block.generation += 1
            block.ref_cnt = 1
        return blocks

    def get_new_block(self) -> KVBlock:
        """`get_new_blocks(1)[0]`, without the lists: the least recently freed block, ref 1.
        (FreeBlockQueue.popleft inlined: change them together.)"""
        queue = self.free_queue
        head = queue._head
        block = head.next_free
        if block is None or block is queue._tail:
            raise ValueError("no free blocks")
        nxt = block.next_free
        head.next_free = nxt
        nxt.prev_free = head
        block.prev_free = block.next_free = None
        queue.num_free_blocks -= 1
        if block.key is not None:  # as get_new_blocks
            del self.cached[block.key]
            block.key = None
        block.generation += 1
        block.ref_cnt = 1
        return block

    # ---- prefix caching ----------------------------------------------------------------
    def lookup(self, key: BlockKey) -> Optional[KVBlock]:
        return self.cached.get(key)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cache hits; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def register(self, block: KVBlock, key: BlockKey) -> None:
        """Publish a held, full block's content. A key already published keeps its block.
        (KVCacheManager's registration loops inline these two lines: change them together.)"""
        if block.key is None and self.cached.setdefault(key, block) is block:  # one hash
            block.key = key

    def _evict(self, block: KVBlock) -> None:
        del self.cached[block.key]
        block.key = None
        block.generation += 1

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 join the free list in the given order
        (so the first given is the first to be reused)."""
        queue, null = self.free_queue, self.null_block
        tail = queue._tail
        last, appended = tail.prev_free, 0
        for block in blocks:
            if block.ref_cnt <= 0 or block is null:
                tail.prev_free = last  # the blocks linked so far stay freed (as before)
                queue.num_free_blocks += appended
                raise ValueError(f"freeing {block}, which is not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:  # FreeBlockQueue.append, inlined (the tail stays linked last)
                last.next_free = block
                block.prev_free = last
                block.next_free = tail
                last = block
                appended += 1
        tail.prev_free = last
        queue.num_free_blocks += appended

    # ---- sharing (forks) ----------------------------------------------------------------
    def share(self, blocks: Iterable[KVBlock]) -> None:
        """One more holder for each of these held blocks (a fork of their holder's table)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"sharing {block}, which is not held")
            block.ref_cnt += 1

    def copy_on_write(self, block: KVBlock) -> KVBlock:
        """A private block for a holder about to write into `block`, which others still hold
        (ref_cnt > 1): a new block (ref 1) is taken and this holder's reference to `block`
        dropped. The caller copies the content (the pool knows no content). Caller checks
        that a block is free."""
        if block.ref_cnt <= 1:
            raise ValueError(f"copy-on-write of {block}, which has no other holder")
        [private] = self.get_new_blocks(1)
        block.ref_cnt -= 1
        return private

    def usage(self) -> float:
        """Fraction of allocatable blocks held, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def check_integrity(self) -> None:
        """Every block is exactly one of: null, free (ref 0), or held (ref > 0)."""
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free list corrupt"
        assert 0 not in free_ids, "null block in the free list"
        for block in self.blocks[1:]:
            in_free = block.prev_free is not None
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert in_free == (block.ref_cnt == 0), f"{block} free-list membership wrong"
        for key, block in self.cached.items():
            assert block.key == key, f"{block} is mapped under a key it does not carry"
