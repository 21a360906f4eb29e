"""Prefix caching: content-keyed full blocks, the LRU free list that keeps content, hits that
take blocks back out of it, and the invariant that a shared block is never written.

Block size 4 throughout, so every block id below is worked out by hand. `KVContentRunner`
models the KV bytes: a wrong hit (a block holding another history) fails its context check.
"""

from __future__ import annotations

from tests.core.harness import (FakeRunner, KVContentRunner, expected_output, make_prompt_request,
                                make_request, make_scheduler, run_to_completion, step)
from tokenweir.core.block_pool import ROOT_PARENT, BlockPool
from tokenweir.core.kv_cache_manager import KVCacheManager

P, Q, R, S = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]
SMALL = dict(block_size=4, watermark=0.0, scheduler_reserve_full_isl=False,
             enable_prefix_caching=True)


def _free_list(s):
    return [b.block_id for b in s.kv.pool.free_queue]


def _new(out):
    return {n.req_id: (n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs}


def _keyed(s):
    """Published block id -> its key's parent block id (-1: root)."""
    return {b.block_id: b.key[0] for b in s.kv.pool.blocks[1:] if b.key is not None}


def _stats(s):
    return s.kv.prefix_stats.queries, s.kv.prefix_stats.hits


def _finish_step(s, runner, out):
    return s.update_from_output(out, runner.execute(out))


# ---- a scripted sequence: exact block ids, LRU order, eviction, stats ---------------------
def test_scripted_hits_evictions_and_stats():
    # 6 usable blocks (ids 1..6). Every request has max_tokens 1: it ends when its prompt is done.
    s = make_scheduler(num_blocks=7, max_model_len=24, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    reqs = {}

    def add(rid, prompt):
        reqs[rid] = make_prompt_request(rid, prompt, 1)
        s.add_request(reqs[rid])

    # A computes P Q + 2 tokens: its two full blocks are published under a chained key.
    add("A", P + Q + [91, 92])
    out, _ = step(s, runner)
    assert _new(out) == {"A": ([1, 2, 3], 0)} and out.num_scheduled_tokens == {"A": 10}
    assert reqs["A"].is_finished and reqs["A"].num_cached_tokens == 0
    assert _keyed(s) == {1: -1, 2: 1}  # block 3 is partial: never published
    # Freed blocks keep their content; the tail block is freed (and so reused) first.
    assert _free_list(s) == [4, 5, 6, 3, 2, 1]
    assert _stats(s) == (10, 0)

    add("B", R + S + [93])
    out, _ = step(s, runner)
    assert _new(out) == {"B": ([4, 5, 6], 0)}  # the never-used blocks go first
    assert _free_list(s) == [3, 2, 1, 6, 5, 4]
    assert _keyed(s) == {1: -1, 2: 1, 4: -1, 5: 4}
    gen5 = s.kv.pool.blocks[5].generation

    # C repeats A's two full blocks; D shares only P. Both hit block 1 (ref count 2); the hits
    # leave the middle of the free list; D's new blocks are the least recently freed, and
    # block 5 (B's S) is evicted to make room.
    add("C", P + Q + [94])
    add("D", P + R + [95])
    out = s.schedule()
    assert _new(out) == {"C": ([1, 2, 3], 8), "D": ([1, 6, 5], 4)}
    assert out.num_scheduled_tokens == {"C": 1, "D": 5}
    assert [s.kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 5, 6)] == [2, 1, 1, 1, 1]
    assert _free_list(s) == [4]
    assert s.kv.pool.blocks[5].key is None and s.kv.pool.blocks[5].generation == gen5 + 1
    assert (reqs["C"].num_cached_tokens, reqs["D"].num_cached_tokens) == (8, 4)
    assert _stats(s) == (37, 12)
    _finish_step(s, runner, out)
    assert reqs["C"].is_finished and reqs["D"].is_finished
    # D published its own second block (R after P) under block 1.
    assert _keyed(s) == {1: -1, 2: 1, 4: -1, 6: 1}
    assert _free_list(s) == [4, 3, 2, 5, 6, 1]

    # E = R Q: R hits block 4, but Q after R is not Q after P: block 2 holds the same four
    # tokens yet is no hit (the chain differs only in the earlier block). F = S Q hits nothing:
    # S was only ever published after R. E's new blocks evict 3 (unpublished) and 2 (P Q);
    # F's evict 5, 6 (P R) and 1 (P).
    add("E", R + Q + [96])
    add("F", S + Q + [97])
    out, _ = step(s, runner)
    assert _new(out) == {"E": ([4, 3, 2], 4), "F": ([5, 6, 1], 0)}
    assert (reqs["E"].num_cached_tokens, reqs["F"].num_cached_tokens) == (4, 0)
    assert _stats(s) == (55, 16)
    assert _keyed(s) == {3: 4, 4: -1, 5: -1, 6: 5}
    assert _free_list(s) == [2, 3, 4, 1, 6, 5]

    # G repeats A's prompt, but P and P Q were evicted: a miss, in the blocks least recently freed.
    add("G", P + Q + [98])
    out, _ = step(s, runner)
    assert _new(out) == {"G": ([2, 3, 4], 0)} and reqs["G"].num_cached_tokens == 0
    assert _stats(s) == (64, 16)
    assert runner.context_checks == 8 + 4 + 4  # C, D and E read their hits
    s.check_integrity()


def test_hit_is_confirmed_by_tokens_not_by_block_content_alone():
    """Two prompts whose second blocks are equal, first blocks not: the second never hits."""
    s = make_scheduler(num_blocks=20, max_model_len=24, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    a = make_prompt_request("a", P + Q + [1], 1)
    s.add_request(a)
    step(s, runner)
    b = make_prompt_request("b", [11, 12, 13, 15] + Q + [1], 1)  # P with its last token changed
    s.add_request(b)
    out, _ = step(s, runner)
    assert b.num_cached_tokens == 0 and out.num_scheduled_tokens == {"b": 9}
    c = make_prompt_request("c", P + [21, 22, 23, 25] + [1], 1)  # Q with its last token changed
    s.add_request(c)
    out, _ = step(s, runner)
    assert c.num_cached_tokens == 4 and out.num_scheduled_tokens == {"c": 5}
    # Probe: the exact prompt does hit both blocks.
    d = make_prompt_request("d", P + Q + [1], 1)
    s.add_request(d)
    out, _ = step(s, runner)
    assert d.num_cached_tokens == 8 and out.num_scheduled_tokens == {"d": 1}
    assert _stats(s) == (36, 12)


def test_reused_parent_block_never_leads_to_its_old_children():
    """Block keys name the parent block *and its generation*. A block that is handed out again
    gets new content, so children published under its old content must become unreachable,
    even when it was never published itself (a duplicate of content already cached)."""
    pool = BlockPool(3)  # blocks 1 and 2
    parent, child = pool.get_new_blocks(2)
    old_generation = parent.generation
    # `parent` holds P but is unpublished (say P was cached elsewhere); `child` holds Q after it.
    pool.register(child, (parent.block_id, parent.generation, tuple(Q)))
    pool.free_blocks([parent])
    pool.free_blocks([child])  # child stays cached, in the free list
    (reused,) = pool.get_new_blocks(1)
    assert reused is parent  # least recently freed
    pool.register(reused, (*ROOT_PARENT, tuple(R)))  # now it holds R
    assert pool.lookup((*ROOT_PARENT, tuple(R))) is reused
    # R Q must miss: `child` holds the KV of Q after P.
    assert pool.lookup((reused.block_id, reused.generation, tuple(Q))) is None
    # Probe: the child is still published under its old key.
    assert pool.lookup((parent.block_id, old_generation, tuple(Q))) is child


def test_free_list_is_lru_with_removal_from_the_middle():
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(6)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5, 6]
    pool.free_blocks([blocks[i] for i in (4, 1, 5, 0, 3, 2)])  # ids 5 2 6 1 4 3
    for i, b in enumerate(blocks):
        pool.register(b, (*ROOT_PARENT, (i,)))
    assert [b.block_id for b in pool.free_queue] == [5, 2, 6, 1, 4, 3]
    pool.touch([blocks[0], blocks[3]])  # hits on ids 1 and 4, in the middle
    assert [b.block_id for b in pool.free_queue] == [5, 2, 6, 3]
    assert pool.num_free_blocks == 4 and blocks[0].ref_cnt == blocks[3].ref_cnt == 1
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    # Allocation takes the least recently freed and drops its key.
    (b5,) = pool.get_new_blocks(1)
    assert b5.block_id == 5 and b5.key is None and pool.lookup((*ROOT_PARENT, (4,))) is None
    assert pool.lookup((*ROOT_PARENT, (1,))) is blocks[1]  # the others keep theirs
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and 1 not in [b.block_id for b in pool.free_queue]
    pool.free_blocks([blocks[0], b5])
    assert [b.block_id for b in pool.free_queue] == [2, 6, 3, 1, 5]
    pool.check_integrity()


# ---- shared blocks are never written -------------------------------------------------------
def test_request_hitting_shared_blocks_computes_into_new_blocks_only():
    s = make_scheduler(num_blocks=40, max_model_len=64, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    prefix = P + Q + R  # three full blocks
    a = make_prompt_request("a", prefix + [1, 2], 6)
    s.add_request(a)
    step(s, runner)
    step(s, runner)  # a decodes: it still holds the shared blocks
    shared = s.kv.block_ids("a")[:3]
    b = make_prompt_request("b", prefix + [5, 6, 7, 8, 9], 6)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens["b"] == 5
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == shared
    assert all(s.kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    # The slots b computes this step: positions 12..16 -> table indices 3 and 4.
    written = {new.block_ids[p // 4] for p in range(12, 17)}
    assert written.isdisjoint(shared) and len(written) == 2
    _finish_step(s, runner, out)
    # ... and every later step too (KVContentRunner asserts each written block is unshared).
    finished = run_to_completion(s, runner)
    assert finished["b"] == expected_output(b) and finished["a"] == expected_output(a)
    assert b.num_cached_tokens == 12 and runner.writes > 0


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make_scheduler(num_blocks=40, max_model_len=64, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    s.add_request(make_prompt_request("a", P + Q + R, 1))
    step(s, runner)
    # Same 12 tokens: the third block holds the last token, which must be computed (for its
    # logits), so only two blocks hit and the third is recomputed into a new block.
    b = make_prompt_request("b", P + Q + R, 3)
    s.add_request(b)
    out, _ = step(s, runner)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 4}
    assert new.block_ids[2] not in s.kv.block_ids("a")  # a finished; its block 3 is free/cached
    # 13 tokens: all three blocks hit, one token left.
    c = make_prompt_request("c", P + Q + R + [7], 3)
    s.add_request(c)
    out, _ = step(s, runner)
    assert _new(out)["c"][1] == 12 and out.num_scheduled_tokens["c"] == 1
    run_to_completion(s, runner)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 12)
    assert b.output_token_ids == expected_output(b) and c.output_token_ids == expected_output(c)


# ---- what gets published, and when ---------------------------------------------------------
def test_chunked_prefill_blocks_are_cached_as_they_fill():
    s = make_scheduler(num_blocks=60, max_model_len=64, max_num_batched_tokens=64,
                       long_prefill_token_threshold=6, max_num_partial_prefills=3, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    prompt = [100 + i for i in range(40)]
    a = make_prompt_request("a", prompt, 2)
    s.add_request(a)
    step(s, runner)
    step(s, runner)
    assert a.num_computed_tokens == 12  # mid-prefill: 3 full blocks computed, 28 to go
    assert len(_keyed(s)) == 3
    b = make_prompt_request("b", prompt, 2)
    s.add_request(b)
    out, _ = step(s, runner)
    # b hits exactly the blocks a had computed when b arrived; a is still mid-chunk.
    assert _new(out)["b"] == (s.kv.block_ids("b"), 12)
    assert s.kv.block_ids("b")[:3] == s.kv.block_ids("a")[:3]
    assert b.num_cached_tokens == 12 and a.num_computed_tokens == 18 < a.num_prompt_tokens
    # a's fourth block, filled in the step that admitted b, is not shared.
    assert s.kv.block_ids("b")[3] != s.kv.block_ids("a")[3]
    # A chunk that ends mid-block publishes only its full blocks: at 18 computed, 4 hit.
    c = make_prompt_request("c", prompt, 2)
    s.add_request(c)
    step(s, runner)
    assert c.num_cached_tokens == 16
    assert s.kv.block_ids("c")[:4] == s.kv.block_ids("a")[:4]
    finished = run_to_completion(s, runner)
    assert finished == {r.request_id: expected_output(r) for r in (a, b, c)}
    assert s.stats.num_chunked_prefill_steps > 0


def test_generated_tokens_full_blocks_are_cached():
    s = make_scheduler(num_blocks=40, max_model_len=64, **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    a = make_prompt_request("a", [7, 8, 9, 10, 11, 12], 10)
    s.add_request(a)
    run_to_completion(s, runner)
    assert a.num_tokens == 16  # computed 15: 3 full blocks, the last two of them output tokens
    history = list(a.all_token_ids)
    b = make_prompt_request("b", history[:14] + [3], 2)
    s.add_request(b)
    out, _ = step(s, runner)
    assert _new(out)["b"][1] == 12 > a.num_prompt_tokens
    c = make_prompt_request("c", history[:8] + [5, 5, 5, 5, 5], 2)  # diverges in a's outputs
    s.add_request(c)
    out, _ = step(s, runner)
    assert _new(out)["c"][1] == 8
    run_to_completion(s, runner)
    assert b.output_token_ids == expected_output(b) and c.output_token_ids == expected_output(c)


def test_recompute_preempted_request_hits_what_survives_of_its_blocks():
    # 7 usable blocks; a, b (prompt 7) and c (prompt 11) decode until the pool runs out.
    s = make_scheduler(num_blocks=8, max_model_len=28, max_num_batched_tokens=64,
                       preemption_mode="recompute", **SMALL)
    runner = KVContentRunner(s.kv.pool, 4)
    a, b, c = make_request("a", 7, 12), make_request("b", 7, 12), make_request("c", 11, 12)
    for r in (a, b, c):
        s.add_request(r)
    while not b.num_preemptions:  # c goes first (fcfs: the tail), then b
        b_blocks = s.kv.block_ids("b")
        step(s, runner)
    assert c.num_preemptions == 1 and b_blocks == [3, 4, 6]
    assert b.num_computed_tokens == 0 and s.kv.num_held_blocks("b") == 0
    assert b.max_computed_tokens == 12 and b.num_tokens == 13
    while b.status.name != "RUNNING":
        out, _ = step(s, runner)
    # Re-admitted: its two full blocks were freed but kept their content, so it hits them
    # and recomputes only positions 8..11 (the tail block, which was never published).
    assert _new(out)["b"] == ([3, 4, 6, 5], 8)
    assert out.num_scheduled_tokens == {"b": 5}
    assert s.stats.recomputed_tokens == 4 < b.num_tokens
    assert b.num_cached_tokens == 0  # set at the first admission only
    run_to_completion(s, runner)
    for r in (a, b, c):
        assert r.is_finished and r.output_token_ids == expected_output(r)
    # c's blocks were reused by a and b meanwhile: a full recompute of its 12 tokens.
    assert s.stats.recomputed_tokens == 4 + 12


def test_prefix_caching_lowers_the_recompute_tax():
    """Same scenario without prefix caching: the re-admission starts from zero and pays more."""
    def run(caching):
        s = make_scheduler(num_blocks=8, max_model_len=28, max_num_batched_tokens=64,
                           block_size=4, watermark=0.0, scheduler_reserve_full_isl=False,
                           enable_prefix_caching=caching)
        for r in (make_request("a", 7, 12), make_request("b", 7, 12), make_request("c", 11, 12)):
            s.add_request(r)
        out = run_to_completion(s, FakeRunner())
        assert s.stats.num_preemptions > 0
        return s, out
    cached, out_cached = run(True)
    plain, out_plain = run(False)
    assert out_cached == out_plain
    assert plain.kv.prefix_stats.hits == 0 and cached.kv.prefix_stats.hits > 0
    assert cached.stats.recomputed_tokens < plain.stats.recomputed_tokens


def test_caching_off_never_hits():
    s = make_scheduler(num_blocks=40, max_model_len=64, block_size=4, watermark=0.0,
                       enable_prefix_caching=False)
    runner = FakeRunner()
    s.add_request(make_prompt_request("a", P + Q + [1], 1))
    step(s, runner)
    b = make_prompt_request("b", P + Q + [1], 1)
    s.add_request(b)
    out, _ = step(s, runner)
    assert b.num_cached_tokens == 0 and out.num_scheduled_tokens == {"b": 9}
    assert not s.kv.pool.cached
    # Probe: the same script with caching on hits.
    kv = KVCacheManager(40, 4, enable_prefix_caching=True)
    a = make_prompt_request("a", P + Q + [1], 1)
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.register_computed_blocks(a)
    assert len(kv.get_computed_blocks(b)) == 2


def test_ids_beyond_int64_key_as_tuples_and_still_hit_exactly():
    """A block with an id that does not pack as int64 is keyed by its tuple (block_tokens_key,
    inlined in the manager's lookup and registration loops): the same prompt hits both
    blocks, a prompt differing only in that id hits neither."""
    huge = 1 << 70
    kv = KVCacheManager(12, 4, enable_prefix_caching=True)
    a = make_prompt_request("a", [huge, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    assert kv.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    kv.register_computed_blocks(a)
    assert any(isinstance(key[2], tuple) for key in kv.pool.cached)  # probe: the tuple form
    same = make_prompt_request("b", [huge, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    assert kv.get_computed_blocks(same).num_blocks == 2
    other = make_prompt_request("c", [huge + 1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    assert kv.get_computed_blocks(other).num_blocks == 0
