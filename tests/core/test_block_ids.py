"""Exact block ids: least recently freed first, block 0 never, tail block freed first."""

from __future__ import annotations

import pytest

from tests.core.harness import FakeRunner, make_request, make_scheduler, step
from tokenweir.core.block_pool import BlockPool


def _new(out):
    return {n.req_id: n.block_ids for n in out.scheduled_new_reqs}


def _cached(out):
    return {c.req_id: c.new_block_ids for c in out.scheduled_cached_reqs}


def _free_list(s):
    return [b.block_id for b in s.kv.pool.free_queue]


def test_scripted_block_ids():
    # 10 usable blocks of 4 tokens: ids 1..10.
    s = make_scheduler(num_blocks=11, block_size=4, max_model_len=40, watermark=0.0,
                       scheduler_reserve_full_isl=False)
    runner = FakeRunner()
    a, b, c = make_request("a", 5, 2), make_request("b", 8, 6), make_request("c", 3, 6)
    for r in (a, b, c):
        s.add_request(r)
    assert _free_list(s) == list(range(1, 11))

    out, _ = step(s, runner)
    assert _new(out) == {"a": [1, 2], "b": [3, 4], "c": [5]}
    assert _free_list(s) == [6, 7, 8, 9, 10]

    out, _ = step(s, runner)  # b's 9th token opens a block; a samples its 2nd token and ends
    assert _cached(out) == {"a": [], "b": [6], "c": []}
    assert a.is_finished and s.kv.block_ids("a") == []
    # a's blocks join the tail of the free list tail-first: 2 before 1.
    assert _free_list(s) == [7, 8, 9, 10, 2, 1]

    d, e = make_request("d", 16, 4), make_request("e", 4, 4)
    s.add_request(d)
    s.add_request(e)
    out, _ = step(s, runner)
    assert out.finished_req_ids == {"a"}
    assert _cached(out) == {"b": [], "c": [7]}  # c's 5th token
    assert _new(out) == {"d": [8, 9, 10, 2], "e": [1]}  # least recently freed first
    assert _free_list(s) == []
    assert s.kv.block_ids("b") == [3, 4, 6] and s.kv.block_ids("c") == [5, 7]

    s.finish_requests(["b"])
    assert _free_list(s) == [6, 4, 3]
    f = make_request("f", 4, 2)
    s.add_request(f)
    out, _ = step(s, runner)
    assert out.finished_req_ids == {"b"}
    # d's 17th and e's 5th token each open a block; f takes the last: b's first block.
    assert _cached(out) == {"c": [], "d": [6], "e": [4]}
    assert _new(out) == {"f": [3]}
    assert _free_list(s) == []
    s.check_integrity()


def test_block_pool_lru_order_and_null_block():
    pool = BlockPool(6)
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0 and pool.null_block.block_id == 0
    pool.free_blocks([got[3], got[1]])
    pool.free_blocks([got[4]])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 2, 5]
    pool.check_integrity()


def test_block_pool_refuses_double_free_and_overdraw():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks[:1])
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    pool.check_integrity()
    assert pool.num_free_blocks == 1 and blocks[0].ref_cnt == 0
