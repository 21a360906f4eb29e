"""Which blocks each request holds, and whether the pool has room for more.

Contract: `allocate_slots` either gives a request every block it needs for its next tokens and
returns the new block ids, or changes nothing and returns None. None means "shed load"; only
the scheduler decides who pays. No torch here.
"""

from __future__ import annotations

from typing import Optional

from tokenweir.core.block_pool import BlockPool, KVBlock
from tokenweir.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

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

    # ---- mutations ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       reserved_blocks: int = 0) -> Optional[list[int]]:
        """Room for `num_new_tokens` after the request's computed ones, or None (nothing changed).

        `reserved_blocks` must stay free after the allocation (the admission watermark).
        """
        total = request.num_computed_tokens + num_new_tokens
        held = self.req_to_blocks.get(request.request_id)
        needed = -(-total // self.block_size) - (len(held) if held else 0)
        if needed <= 0:
            return []  # the hot path: a decode inside its last block
        if needed > self.pool.num_free_blocks - reserved_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(needed)
        if held is None:
            self.req_to_blocks[request.request_id] = new_blocks
        else:
            held.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Release every block the request holds. The tail block is freed first, so a request's
        later blocks are reused before its earlier ones."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))

    def check_integrity(self) -> None:
        """Blocks are conserved: free + held by requests == usable, and no block has two owners."""
        self.pool.check_integrity()
        held = [b.block_id for blocks in self.req_to_blocks.values() for b in blocks]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert self.pool.num_free_blocks + len(held) == self.pool.num_usable_blocks, (
            f"blocks not conserved: {self.pool.num_free_blocks} free + {len(held)} held "
            f"!= {self.pool.num_usable_blocks}")
