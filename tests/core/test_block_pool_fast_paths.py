"""The block pool's fast paths do what the general ones do (issue 36, simrun8):
`get_new_block()` is `get_new_blocks(1)[0]`, and `free_blocks` (its free-list append inlined)
keeps the free list's order and counts, also when it refuses a block part way."""

from __future__ import annotations

import random

import pytest

from tokenweir.core.block_pool import BlockPool


def _state(pool: BlockPool) -> tuple:
    return ([b.block_id for b in pool.free_queue], pool.num_free_blocks,
            [(b.ref_cnt, b.generation, b.key) for b in pool.blocks],
            sorted((k, b.block_id) for k, b in pool.cached.items()))


def _drive(pool: BlockPool, one_at_a_time: bool, seed: int) -> list[int]:
    """A random history of takes, publishes and frees; returns the ids handed out."""
    rng, held, handed = random.Random(seed), [], []
    for step in range(400):
        if held and (rng.random() < 0.45 or pool.num_free_blocks == 0):
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free_blocks(held[:k])
            del held[:k]
        else:
            block = pool.get_new_block() if one_at_a_time else pool.get_new_blocks(1)[0]
            handed.append(block.block_id)
            if rng.random() < 0.6:
                pool.register(block, (-1, 0, step % 7, step))
            held.append(block)
    pool.check_integrity()
    return handed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_get_new_block_is_get_new_blocks_of_one(seed):
    fast, general = BlockPool(12), BlockPool(12)
    assert _drive(fast, True, seed) == _drive(general, False, seed)
    assert _state(fast) == _state(general)
    assert any(b.generation > 1 for b in fast.blocks)  # probe: blocks were reused
    assert fast.cached  # probe: published content was kept (and evicted on reuse)


def test_get_new_block_drops_the_published_key_and_bumps_the_generation():
    pool = BlockPool(2)
    block = pool.get_new_block()
    pool.register(block, (-1, 0, b"x"))
    pool.free_blocks([block])
    again = pool.get_new_block()
    assert again is block and block.key is None and block.generation == 2
    assert pool.cached == {}
    with pytest.raises(ValueError):
        pool.get_new_block()


def test_free_blocks_refusing_part_way_keeps_the_list_whole():
    pool = BlockPool(6)
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([d, b, a, c])  # a is not held: d and b were freed before it
    assert [x.block_id for x in pool.free_queue] == [a.block_id, d.block_id, b.block_id]
    assert pool.num_free_blocks == 3 and c.ref_cnt == 1
    pool.check_integrity()
    pool.free_blocks([e, c])
    assert [x.block_id for x in pool.get_new_blocks(5)] == [1, 4, 2, 5, 3]
