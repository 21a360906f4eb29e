"""Which blocks each request holds, whether the pool has room for more, and the prefix cache.

Contract: `allocate_slots` either gives a request every block it needs for its next tokens and
returns the new block ids, or changes nothing and returns None. None means "shed load"; only
the scheduler decides who pays. No torch here.

Prefix caching (when enabled): a request's full blocks are published in the pool's content map
once the step that computed them has run (`register_computed_blocks`, called from the
scheduler's update), so a hit never reads K/V that was planned but not written.
`get_computed_blocks` finds the longest run of a new request's leading full blocks in the map.

The scheduler reads this manager only through its public methods and the typed answers below
(`ComputedBlocks`, `PreemptionFootprint`, `SwapIn`), never through blocks' ref counts or the
manager's bookkeeping (tests/core/test_kv_api.py holds it to that).

Swap: `swap_out` moves a request's blocks to a bounded host pool (ids only: the runner copies
the bytes) and frees its device blocks; `swap_in` does the reverse.

Forks (parallel sampling, request.SampleGroup): `fork` gives each child a reference to every
block of its parent that holds the child's computed tokens and the slot of its next one; the
blocks are shared (ref count > 1), never copied up front. Parent and children are then "fresh
forks": the next allocation of each (`allocate_fork_slots`) copies the block its next token
is written into when another holder still has it (copy-on-write: a (source, destination) pair
the runner copies before the step's forward), and writes in place when it is the block's last
holder. So every write goes into a block its writer holds alone (tests/core/harness.py's
KVContentRunner checks it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Optional, Union

from tokenweir.core.block_pool import ROOT_PARENT, BlockKey, BlockPool, KVBlock
from tokenweir.core.sliding_window import num_blocks_to_skip
from tokenweir.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key_packer(block_size: int) -> Callable[..., bytes]:
    """The `pack` of `block_tokens_key` for blocks of `block_size` ids (int64s)."""
    return struct.Struct(f"{block_size}q").pack


def block_tokens_key(pack: Callable[..., bytes], tokens: list[int]) -> Union[bytes, tuple]:
    """A full block's token ids as its prefix-cache key holds them: packed as int64s by
    `pack`, or their tuple when one does not fit (such a block can match only blocks of the
    same ids, which take the same form). Equal keys still mean equal ids. A bytes object keeps
    its hash and refers to no int objects: dropping a published block's key (each time a block
    is handed out again) neither hashes its ids again nor touches one object per id.
    (KVCacheManager's lookup and registration loops inline it: change them together.)"""
    try:
        return pack(*tokens)
    except struct.error:
        return tuple(tokens)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens served from the cache


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A new request's prefix-cache hit (vLLM's KVCacheBlocks plays this role): pass it back
    to `allocate_slots` unchanged; the blocks inside are the manager's business."""

    blocks: tuple[KVBlock, ...]
    block_size: int

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, leading: slice) -> "ComputedBlocks":
        """The leading hits only (`hits[:n]`)."""
        return ComputedBlocks(self.blocks[leading], self.block_size)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def num_evictable(self) -> int:
        """Hits sitting in the free list: taking them costs free blocks like new ones do."""
        return sum(1 for b in self.blocks if b.ref_cnt == 0)


@dataclass(frozen=True, slots=True)
class PreemptionFootprint:
    """What preempting a running request would lose or move."""

    lost_tokens: int  # computed tokens a recompute loses (shared blocks survive it)
    swappable_blocks: int  # blocks a swap would move (all but the leading shared run)
    can_swap: bool  # the host pool has room for them (and there is something to move)


@dataclass(frozen=True, slots=True)
class ForkSlots:
    """A fork's first allocation: copies to make, and its whole block table after them."""

    copies: list[tuple[int, int]]  # (source device block, destination device block)
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class SwapIn:
    """A swapped-out request brought back: copies to make, and the block ids it got."""

    copies: list[tuple[int, int]]  # (host block, device block) pairs, before the step
    block_ids: list[int]  # the copied-in device blocks, then the new ones for its next tokens


class HostBlockPool:
    """Host-side block ids for swapped-out KV. No content map, no LRU: a plain free list."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} host blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, sliding_window: Optional[int] = None) -> None:
        """`sliding_window` (tokens each query attends; None: all): blocks wholly before every
        future query's window are returned to the pool as the request grows (sliding_window.py);
        its block table then holds the null block in their place."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._num_skipped: dict[str, int] = {}  # leading blocks freed for the window, per request
        self._pack = block_key_packer(block_size)  # a full block's ids (block_tokens_key)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_registered: dict[str, int] = {}  # leading blocks already published
        # Requests whose published blocks may lag their computed full blocks although no step
        # filled a block (a swap-out unpublished some). For every other request,
        # num_registered == num_computed_tokens // block_size between steps, so
        # `register_computed_blocks` has work only after a step that fills a block
        # (`needs_registration`; the scheduler inlines that test).
        self.registration_behind: set[str] = set()
        self.req_to_host_blocks: dict[str, list[int]] = {}
        # Forks not allocated since `fork`: their next write goes into a shared block.
        self._fresh_forks: set[str] = set()
        self.prefix_stats = PrefixCacheStats()
        self._no_hits = ComputedBlocks((), block_size)

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request: Request, total_tokens: int) -> int:
        """Blocks to add so the request can hold `total_tokens` tokens."""
        held = self.num_held_blocks(request.request_id)
        return max(0, self.blocks_for_tokens(total_tokens) - held)

    def num_shared_tokens(self, request: Request) -> int:
        """Computed tokens in blocks someone else also holds: they survive this request's
        preemption for certain, and a recompute finds them again through the prefix cache
        (none without it: a fork's shared blocks are then lost to its recompute)."""
        if not self.enable_prefix_caching:
            return 0
        blocks = self.req_to_blocks.get(request.request_id, ())
        shared = sum(1 for b in blocks if b.ref_cnt > 1)
        return min(shared * self.block_size, request.num_computed_tokens)

    # ---- prefix cache ------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of the request's leading full blocks already cached. At least one
        token is always left to compute (the step must produce logits). Takes no reference."""
        if not self.enable_prefix_caching:
            return self._no_hits
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        cached, pack, bs = self.pool.cached, self._pack, self.block_size
        parent_id, parent_generation = ROOT_PARENT
        for k in range(max_blocks):  # pool.lookup(self._key(parent, tokens, k)), inlined
            chunk = tokens[k * bs:(k + 1) * bs]
            try:  # block_tokens_key(pack, chunk), inlined
                ids = pack(*chunk)
            except struct.error:
                ids = tuple(chunk)
            block = cached.get((parent_id, parent_generation, ids))
            if block is None:
                break
            hits.append(block)
            parent_id, parent_generation = block.block_id, block.generation
        return ComputedBlocks(tuple(hits), bs)

    def num_blocks_to_admit(self, num_tokens: int, computed: ComputedBlocks,
                            num_forks: int = 0, num_prompt_tokens: int = 0) -> int:
        """Free blocks an admission holding `num_tokens` would take, `computed` included (a
        hit in the free list takes one; a hit held by another request takes none), plus, for
        a parallel-sampling parent, what each of its `num_forks` other samples of
        `num_tokens` takes at most: all but the blocks it shares for good (the full ones
        before the prompt's last token)."""
        per_fork = self.blocks_for_tokens(num_tokens) - (num_prompt_tokens - 1) // self.block_size
        return self.blocks_for_tokens(num_tokens) - computed.num_blocks \
            + computed.num_evictable + (num_forks * per_fork if num_forks else 0)

    def _key(self, parent: tuple[int, int], tokens: list[int], k: int) -> BlockKey:
        bs = self.block_size
        return (*parent, block_tokens_key(self._pack, tokens[k * bs:(k + 1) * bs]))

    def register_computed_blocks(self, request: Request,
                                 filled_ids: Union[bytes, tuple, None] = None) -> None:
        """Publish the request's full blocks whose K/V is computed (`num_computed_tokens`).

        `filled_ids`: the last full block's ids as `block_tokens_key` gives them, from a caller
        whose `all_token_ids` lags the computed tokens (a decode stretch appends its rows'
        tokens late); only when that block is the one not yet published."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        full = request.num_computed_tokens // self.block_size
        start = self.num_registered.get(rid, 0)
        if full <= start:
            return
        if filled_ids is not None:  # its one block full - 1, keyed by `filled_ids`
            assert start == full - 1, f"{rid}: {full - start} blocks to publish, one key given"
            blocks = self.req_to_blocks[rid]
            block = blocks[full - 1]
            if full == 1:
                key = (*ROOT_PARENT, filled_ids)
            else:
                parent = blocks[full - 2]
                # freed for the window: no key (the loop's break below)
                key = None if parent.block_id == 0 else \
                    (parent.block_id, parent.generation, filled_ids)
            # pool.register(block, key), inlined
            if key is not None and block.key is None and \
                    self.pool.cached.setdefault(key, block) is block:
                block.key = key
            self.num_registered[rid] = full
            if self.registration_behind:
                self.registration_behind.discard(rid)
            return
        blocks, tokens, bs = self.req_to_blocks[rid], request.all_token_ids, self.block_size
        cached, pack = self.pool.cached, self._pack
        for k in range(start, full):
            chunk = tokens[k * bs:(k + 1) * bs]
            try:  # block_tokens_key(pack, chunk), inlined
                ids = pack(*chunk)
            except struct.error:
                ids = tuple(chunk)
            if k == 0:
                key = (*ROOT_PARENT, ids)
            else:  # self._key((parent id, parent generation), tokens, k), inlined
                parent = blocks[k - 1]
                if parent.block_id == 0:  # freed for the window (after a swap-out): no key
                    break
                key = (parent.block_id, parent.generation, ids)
            block = blocks[k]  # pool.register(block, key), inlined
            if block.key is None and cached.setdefault(key, block) is block:
                block.key = key
        self.num_registered[rid] = full
        self.registration_behind.discard(rid)

    def has_lagging_registrations(self) -> bool:
        """True while some request's published blocks lag its computed full blocks although no
        step filled a block (after a swap-out). While False, `register_computed_blocks` has
        work only for a request whose computed tokens crossed a block boundary this step;
        while True, calling it for any request is safe (it does nothing when nothing lags)."""
        return bool(self.registration_behind)

    def needs_registration(self, request: Request, num_new_tokens: int) -> bool:
        """False only when `register_computed_blocks` would do nothing after a step that added
        `num_new_tokens` to the request's computed tokens: no block filled, none lagging."""
        return self.enable_prefix_caching and (
            request.num_computed_tokens % self.block_size < num_new_tokens
            or request.request_id in self.registration_behind)

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Optional[ComputedBlocks] = None,
                       reserved_blocks: int = 0) -> Optional[list[int]]:
        """Room for `num_new_tokens` after the request's computed ones, or None (nothing changed).

        `computed_blocks` (admission only, from `get_computed_blocks`) become the request's first
        blocks, covering its first len(computed_blocks) * block_size tokens. `reserved_blocks`
        must stay free after the allocation (the admission watermark). Returns the ids of the
        blocks added (cache hits included).
        """
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if held is not None and (computed_blocks is None or not computed_blocks.blocks):
            # the hot path: a running request grows
            if self.sliding_window is not None:
                self._free_blocks_outside_window(request, held)
            needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) \
                - len(held)  # cdiv(tokens, block_size) - held, inlined
            if needed <= 0:
                return []
            if needed > self.pool.free_queue.num_free_blocks - reserved_blocks:
                return None
            if needed == 1:  # a decode crossing a block boundary: the commonest growth
                block = self.pool.get_new_block()
                held.append(block)
                return [block.block_id]
            new_blocks = self.pool.get_new_blocks(needed)
            held.extend(new_blocks)
            return [b.block_id for b in new_blocks]
        hits = list(computed_blocks.blocks) if computed_blocks is not None else []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        needed = cdiv(total, self.block_size) - (len(held) if held else 0) - len(hits)
        if needed <= 0 and not hits:
            return []
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)  # touching takes them off the free list
        if needed + free_hits > self.pool.num_free_blocks - reserved_blocks:
            return None
        self.pool.touch(hits)
        new_blocks = hits + self.pool.get_new_blocks(max(needed, 0))
        if held is None:
            self.req_to_blocks[rid] = held = []
            self.num_registered[rid] = len(hits)
        held.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _free_blocks_outside_window(self, request: Request, held: list[KVBlock]) -> None:
        """Return the request's blocks that lie before every future query's window to the pool
        (tail first, as `free` does), holding the null block in their table slots: positions
        keep their slots, so `len(held)` still counts the slots its tokens span. A published
        block stays cached while free, and a later request can still hit it."""
        rid = request.request_id
        done = self._num_skipped.get(rid, 0)
        registered = self.num_registered.get(rid, 0) if self.enable_prefix_caching else None
        skip = min(len(held), num_blocks_to_skip(request.num_computed_tokens, self.sliding_window,
                                                 self.block_size, registered))
        if skip <= done:
            return
        null = self.pool.null_block
        # slots below `done` are null; a hit or a swap-in may have left some held (not null)
        out = [b for b in held[done:skip] if b is not null]
        held[done:skip] = [null] * (skip - done)
        self._num_skipped[rid] = skip
        self.pool.free_blocks(reversed(out))

    def num_freed_for_window(self, request_id: str) -> int:
        """Leading block slots of the request whose blocks went back to the pool (its window)."""
        return self._num_skipped.get(request_id, 0)

    # ---- forks (parallel sampling) ----------------------------------------------------------
    def fork(self, parent: Request, children: list[Request]) -> None:
        """Each child (its num_computed_tokens set, at most the parent's) takes a reference to
        each of the parent's blocks that holds its computed tokens or its next token's slot;
        parent and children become fresh forks."""
        parent_blocks = self.req_to_blocks[parent.request_id]
        parent_registered = self.num_registered.get(parent.request_id, 0)
        self._fresh_forks.add(parent.request_id)
        for child in children:
            blocks = parent_blocks[:self.blocks_for_tokens(child.num_computed_tokens + 1)]
            self.pool.share(b for b in blocks if b is not self.pool.null_block)
            if self._num_skipped.get(parent.request_id):  # the window's null slots come along
                self._num_skipped[child.request_id] = self._num_skipped[parent.request_id]
            rid = child.request_id
            self.req_to_blocks[rid] = list(blocks)
            self.num_registered[rid] = min(parent_registered,
                                           child.num_computed_tokens // self.block_size)
            self._fresh_forks.add(rid)

    def fresh_forks(self) -> set[str]:
        """Ids of the forks whose next allocation must be `allocate_fork_slots` (read-only)."""
        return self._fresh_forks

    def allocate_fork_slots(self, request: Request, num_new_tokens: int) -> Optional[ForkSlots]:
        """A fresh fork's room for `num_new_tokens` after its computed ones, copying the block
        they start in when it is shared (see the module contract); None (nothing changed) when
        the pool lacks the blocks."""
        rid = request.request_id
        blocks, bs = self.req_to_blocks[rid], self.block_size
        k = request.num_computed_tokens // bs  # the block its next token is written into
        copy = k < len(blocks) and blocks[k].ref_cnt > 1
        grow = max(0, self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
                   - len(blocks))
        if grow + copy > self.pool.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        if copy:
            shared = blocks[k]
            blocks[k] = private = self.pool.copy_on_write(shared)
            copies.append((shared.block_id, private.block_id))
            self.num_registered[rid] = min(self.num_registered[rid], k)
        blocks.extend(self.pool.get_new_blocks(grow))
        self._fresh_forks.discard(rid)
        return ForkSlots(copies, [b.block_id for b in blocks])

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release every block the request holds (device and host). The tail block is freed
        first, so a request's later blocks are reused before its earlier ones."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.num_registered.pop(rid, None)
        if self.registration_behind:  # (the sets are empty on a run without swaps, forks)
            self.registration_behind.discard(rid)
        if self._fresh_forks:
            self._fresh_forks.discard(rid)
        if self._num_skipped and self._num_skipped.pop(rid, 0):  # its null blocks stay
            blocks = [b for b in blocks if b is not self.pool.null_block]
        self.pool.free_blocks(reversed(blocks))
        if self.req_to_host_blocks:
            self.host_pool.free(self.req_to_host_blocks.pop(rid, []))

    # ---- swap --------------------------------------------------------------------------
    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.req_to_host_blocks

    def num_swappable_blocks(self, request: Request) -> int:
        """Blocks a swap would move: all but the leading run shared with other holders
        (a shared block frees no memory, so it stays on the device, held)."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        shared = 0
        null = self.pool.null_block  # null slots (sliding window) lead, and stay too
        while shared < len(blocks) and (blocks[shared].ref_cnt > 1 or blocks[shared] is null):
            shared += 1
        return len(blocks) - shared

    def can_swap_out(self, request: Request) -> bool:
        return 0 < self.num_swappable_blocks(request) <= self.host_pool.num_free_blocks

    def preemption_footprint(self, request: Request) -> PreemptionFootprint:
        swappable = self.num_swappable_blocks(request)
        return PreemptionFootprint(
            request.num_computed_tokens - self.num_shared_tokens(request), swappable,
            0 < swappable <= self.host_pool.num_free_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's unshared blocks to host blocks; returns (device id, host id) pairs
        to copy before the device blocks are reused. The shared leading blocks stay held.
        Caller checks `can_swap_out` first."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        keep = len(blocks) - self.num_swappable_blocks(request)
        moved = blocks[keep:]
        del blocks[keep:]
        if not blocks:
            del self.req_to_blocks[rid]
        self.num_registered[rid] = min(self.num_registered.get(rid, 0), keep)
        self.registration_behind.add(rid)
        self._fresh_forks.discard(rid)  # its moved blocks come back private
        host_ids = self.host_pool.allocate(len(moved))
        self.req_to_host_blocks[rid] = host_ids
        self.pool.free_blocks(reversed(moved))  # content stays cached for prefix hits
        return [(b.block_id, h) for b, h in zip(moved, host_ids)]

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self.req_to_host_blocks.get(request_id, ()))

    def swap_in(self, request: Request, reserved_blocks: int = 0) -> Optional[list[tuple[int, int]]]:
        """Device blocks for a swapped-out request's host blocks, appended after the blocks it
        kept; returns (host id, device id) pairs to copy, or None (nothing changed) when the
        pool lacks room."""
        rid = request.request_id
        host_ids = self.req_to_host_blocks[rid]
        if len(host_ids) > self.pool.num_free_blocks - reserved_blocks:
            return None
        del self.req_to_host_blocks[rid]
        blocks = self.pool.get_new_blocks(len(host_ids))
        self.req_to_blocks.setdefault(rid, []).extend(blocks)
        self.num_registered.setdefault(rid, 0)
        self.host_pool.free(host_ids)
        return [(h, b.block_id) for h, b in zip(host_ids, blocks)]

    def readmit_swapped(self, request: Request, num_new_tokens: int,
                        reserved_blocks: int = 0) -> Optional[SwapIn]:
        """Bring a swapped-out request back and give it room for `num_new_tokens` after its
        computed ones, or None (nothing changed) when the pool cannot keep `reserved_blocks`
        free after both."""
        rid = request.request_id
        swapped, kept = self.num_swapped_blocks(rid), self.num_held_blocks(rid)
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        if max(swapped, total - kept) > self.num_free_blocks - reserved_blocks:
            return None
        copies = self.swap_in(request, reserved_blocks)
        assert copies is not None
        new_block_ids = self.allocate_slots(request, num_new_tokens,
                                            reserved_blocks=reserved_blocks)
        assert new_block_ids is not None
        return SwapIn(copies, [device for _, device in copies] + new_block_ids)

    # ---- checks ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Blocks are conserved in both pools; a device block's holders are its ref count."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            for k, block in enumerate(blocks):
                if block.block_id == 0:  # a window's freed slot: leading, and counted as such
                    assert k < self._num_skipped.get(rid, 0), f"{rid}: null block at slot {k}"
                    continue
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block} ref count != {refs.get(block.block_id, 0)} holders")
        assert self.pool.num_free_blocks + len(refs) == self.pool.num_usable_blocks, (
            f"blocks not conserved: {self.pool.num_free_blocks} free + {len(refs)} held "
            f"!= {self.pool.num_usable_blocks}")
        host_held = [h for ids in self.req_to_host_blocks.values() for h in ids]
        assert len(host_held) == len(set(host_held)), "a host block is held twice"
        assert self.host_pool.num_free_blocks + len(host_held) == self.host_pool.num_blocks, (
            "host blocks not conserved")
