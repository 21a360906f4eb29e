"""Sliding-window attention and the KV pool: which of a request's leading blocks no query will
read again, so the KV cache manager can return them to the pool (as vLLM v1's sliding-window
manager does). No torch.

With a window of W tokens, the query at position p attends positions p - W + 1 .. p. A request
with `num_computed` tokens computes position `num_computed` next, and every later query lies
further right, so a block whose positions all lie below `num_computed - W + 1` is never read
again: `first_block_in_window` is the index of the first block still read.
"""

from __future__ import annotations

from typing import Optional


def first_block_in_window(num_computed: int, window: int, block_size: int) -> int:
    """Index of the first block the next query (position `num_computed`) still reads; every
    block before it lies wholly outside the window of this and every later query."""
    return max(0, num_computed - window + 1) // block_size


def num_blocks_to_skip(num_computed: int, window: Optional[int], block_size: int,
                       num_registered: Optional[int]) -> int:
    """How many leading blocks of the request may be held by the null block (freed): those
    before the window. With prefix caching (`num_registered` given: the leading blocks already
    published), the last published block is kept too, because the next block to publish names
    it as its parent (its id and generation) in its key."""
    if window is None:
        return 0
    skip = first_block_in_window(num_computed, window, block_size)
    if num_registered is not None:
        skip = min(skip, max(0, num_registered - 1))
    return skip
