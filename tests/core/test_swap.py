"""Swap preemption: a victim's blocks go to the host pool and come back without recompute;
a full host pool falls back to recompute; auto picks the cheaper by PreemptionCosts.

`KVContentRunner` copies the KV bytes in the contract's order (swap-ins, swap-outs, forward) and
checks every position a step attends to, so a wrong pair or a wrong order fails there.
"""

from __future__ import annotations

import pytest

from tests.core.harness import (KVContentRunner, check_swap_order, device_tables,
                                expected_output, make_prompt_request, make_request,
                                make_scheduler, run_to_completion, step)
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.request import RequestStatus

CRAMPED = dict(block_size=4, watermark=0.0, scheduler_reserve_full_isl=False,
               max_model_len=28, max_num_batched_tokens=64)
P, Q = [11, 12, 13, 14], [21, 22, 23, 24]


def _setup(mode="swap", num_host_blocks=8, caching=False, costs=None):
    """7 usable blocks. a, b (prompt 7) and c (prompt 11), 12 tokens each: prefill in step 1,
    decode; at step 3 a and b need a third block and c (the fcfs tail, 3 blocks) pays."""
    s = make_scheduler(num_blocks=8, preemption_mode=mode, num_host_blocks=num_host_blocks,
                       enable_prefix_caching=caching, costs=costs, **CRAMPED)
    runner = KVContentRunner(s.kv.pool, 4)
    reqs = [make_request("a", 7, 12), make_request("b", 7, 12), make_request("c", 11, 12)]
    for r in reqs:
        s.add_request(r)
    step(s, runner)
    step(s, runner)
    assert [s.kv.block_ids(x) for x in "abc"] == [[1, 2], [3, 4], [5, 6, 7]]
    return s, runner, reqs


def _step(s, runner):
    held = device_tables(s)
    out, _ = step(s, runner)
    check_swap_order(out, s, held, {rid: runner.blocks[rid] for rid in out.num_scheduled_tokens})
    s.check_integrity()
    return out


def _host_free(s):
    return s.kv.host_pool.num_free_blocks


def test_swap_out_keeps_computed_tokens_and_frees_device_blocks():
    s, runner, (a, b, c) = _setup()
    out = _step(s, runner)
    assert out.preempted_req_ids == {"c"}
    assert out.blocks_to_swap_out == [(5, 0), (6, 1), (7, 2)]  # (device, host), in table order
    assert out.blocks_to_swap_in == []
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 12
    assert s.kv.is_swapped("c") and s.kv.num_held_blocks("c") == 0
    assert s.kv.num_swapped_blocks("c") == 3 and _host_free(s) == 5
    # The device blocks were freed this step and two of them handed straight to a and b: safe,
    # since the runner copies them out before the forward writes them.
    assert s.kv.block_ids("a") == [1, 2, 7] and s.kv.block_ids("b") == [3, 4, 6]
    assert {5} == {blk.block_id for blk in s.kv.pool.free_queue}
    assert (s.stats.num_swapped_out, s.stats.blocks_swapped_out) == (1, 3)
    assert s.stats.num_preemptions == 1 and c.num_preemptions == 1


def test_swapped_request_resumes_without_recompute():
    s, runner, (a, b, c) = _setup()
    swap_ins = []
    while s.has_unfinished_requests():
        out = _step(s, runner)
        if out.blocks_to_swap_in:
            swap_ins.append(out)
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r)
    # c went out first, then b (fcfs: the tail) at step 7; b comes back first (the queue front).
    assert s.stats.num_swapped_out == 2 and s.stats.num_swapped_in == 2
    assert s.stats.recomputed_tokens == 0
    b_in, c_in = swap_ins
    assert b_in.blocks_to_swap_in == [(3, 4), (4, 3), (5, 6)]  # (host, device)
    ((new_b,),) = [b_in.scheduled_new_reqs]
    assert new_b.req_id == "b" and new_b.num_computed_tokens == 12
    assert new_b.block_ids[:3] == [4, 3, 6] and b_in.num_scheduled_tokens == {"b": 1}
    assert c_in.blocks_to_swap_in == [(0, 2), (1, 1), (2, 7)]
    assert c_in.scheduled_new_reqs[0].num_computed_tokens == 12
    assert _host_free(s) == 8 and not s.kv.req_to_host_blocks
    assert runner.context_checks >= 2 * 12  # the swapped-in KV was read back and checked


def test_full_host_pool_falls_back_to_recompute():
    s, runner, (a, b, c) = _setup(num_host_blocks=3)
    out = _step(s, runner)
    assert out.blocks_to_swap_out == [(5, 0), (6, 1), (7, 2)]  # c fits the host pool exactly
    assert _host_free(s) == 0
    while not b.num_preemptions:
        out = _step(s, runner)
    # b (3 blocks) finds the host pool full: recompute.
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_out == []
    assert b.num_computed_tokens == 0 and not s.kv.is_swapped("b")
    assert s.kv.num_swapped_blocks("c") == 3
    run_to_completion(s, runner)
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r)
    # Both happened: one swap, one recompute (the recompute tax is b's 12 computed tokens).
    assert s.stats.num_swapped_out == s.stats.num_swapped_in == 1
    assert s.stats.num_preemptions == 2 and s.stats.recomputed_tokens == 12


def test_no_host_pool_means_recompute_even_in_swap_mode():
    s, runner, (a, b, c) = _setup(num_host_blocks=0)
    out = _step(s, runner)
    assert out.preempted_req_ids == {"c"} and not out.blocks_to_swap_out
    assert c.num_computed_tokens == 0 and s.stats.num_swapped_out == 0


def test_abort_of_swapped_request_frees_its_host_blocks():
    s, runner, (a, b, c) = _setup()
    _step(s, runner)
    assert s.kv.is_swapped("c") and _host_free(s) == 5
    s.finish_requests(["c"])
    assert c.status == RequestStatus.FINISHED_ABORTED
    assert not s.kv.is_swapped("c") and _host_free(s) == 8
    s.check_integrity()
    out = _step(s, runner)
    assert "c" in out.finished_req_ids and not out.blocks_to_swap_in
    run_to_completion(s, runner)
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)
    assert s.stats.num_swapped_in == 1  # b, swapped out later, came back; c never did


def test_swap_with_prefix_caching_device_blocks_stay_hittable():
    """A swapped-out request's freed device blocks keep their published content: a new request
    hits them while the owner is on the host, and the owner later comes back into other
    blocks without recompute."""
    s = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=64,
                       watermark=0.0, scheduler_reserve_full_isl=False, preemption_mode="swap",
                       num_host_blocks=8, enable_prefix_caching=True,
                       scheduling_policy="priority", preemption_policy="fcfs")
    runner = KVContentRunner(s.kv.pool, 4)
    a = make_request("a", 7, 12)
    c = make_prompt_request("c", P + Q + [5, 6, 7, 8, 9], 11)
    for r in (a, c):
        s.add_request(r)
    _step(s, runner)
    _step(s, runner)
    assert s.kv.block_ids("a") == [1, 2] and s.kv.block_ids("c") == [3, 4, 5, 6]
    out = _step(s, runner)  # a needs a third block: c (the tail) is swapped out
    assert out.blocks_to_swap_out == [(3, 0), (4, 1), (5, 2), (6, 3)]
    assert s.kv.block_ids("a") == [1, 2, 6]  # c's tail block, freed first
    d = make_prompt_request("d", P + Q + [9], 1, priority=-1)  # ahead of c in the queue
    s.add_request(d)
    out = _step(s, runner)
    assert out.scheduled_new_reqs[0].block_ids == [3, 4, 5]
    assert d.num_cached_tokens == 8 and s.kv.is_swapped("c")
    run_to_completion(s, runner)
    for r in (a, c, d):
        assert r.output_token_ids == expected_output(r)
    assert s.stats.num_swapped_in == s.stats.num_swapped_out == 1
    assert s.stats.recomputed_tokens == 0


# ---- auto: the cheaper of the two, by PreemptionCosts --------------------------------------
@pytest.mark.parametrize("costs,expect_swap", [
    (PreemptionCosts(prefill_seconds_per_token=1e-3, swap_seconds_per_block=1e-6), True),
    (PreemptionCosts(prefill_seconds_per_token=1e-9, swap_seconds_per_block=1e-3), False),
])
def test_auto_follows_the_costs(costs, expect_swap):
    s, runner, (a, b, c) = _setup(mode="auto", costs=costs)
    out = _step(s, runner)
    assert out.preempted_req_ids == {"c"}
    assert bool(out.blocks_to_swap_out) == expect_swap == s.kv.is_swapped("c")
    assert c.num_computed_tokens == (12 if expect_swap else 0)
    run_to_completion(s, runner)
    assert c.output_token_ids == expected_output(c)
    assert (s.stats.recomputed_tokens == 0) == expect_swap


@pytest.mark.parametrize("shared", [True, False])
def test_auto_recomputes_a_victim_that_loses_little(shared):
    """A token to prefill costs 1e-5 s, a block copy 1.6e-5 s. With 8 of its 17 computed tokens
    in 2 blocks x holds too, c loses 9 tokens (9e-5 s) < copying its 3 unshared blocks out and
    back (9.6e-5 s): recompute. Without the shared prefix c (preempted earlier) loses all 13
    (1.3e-4 s) > 2 * 4 copies (1.28e-4 s): swap."""
    s = make_scheduler(num_blocks=8, preemption_mode="auto", num_host_blocks=8,
                       enable_prefix_caching=True, costs=PreemptionCosts(1e-5, 1.6e-5), **CRAMPED)
    runner = KVContentRunner(s.kv.pool, 4)
    x = make_prompt_request("x", P + Q + [1], 12)
    s.add_request(x)
    _step(s, runner)
    c = make_prompt_request("c", (P + Q if shared else [7] * 8) + [5, 6, 7], 12)
    s.add_request(c)
    while not c.num_preemptions:
        held, computed = s.kv.num_held_blocks("c"), c.num_computed_tokens
        shared_tokens = s.kv.num_shared_tokens(c)
        out = _step(s, runner)
    assert out.preempted_req_ids == {"c"}
    assert (held, computed, shared_tokens) == ((5, 17, 8) if shared else (4, 13, 0))
    assert s.stats.num_swapped_out == (0 if shared else 1)
    run_to_completion(s, runner)
    assert c.output_token_ids == expected_output(c) and x.output_token_ids == expected_output(x)
    if shared:
        # Recompute, but cheap: c's own blocks were still cached when it came back.
        assert 0 < s.stats.recomputed_tokens < computed
