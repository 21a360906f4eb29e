"""Victim choice and what preemption does to the victim (recompute: front of the queue)."""

from __future__ import annotations

from tests.core.harness import (FakeRunner, expected_output, make_request, make_scheduler,
                                run_to_completion, step)
from tokenweir.core.sched import policy


def choose_victim(running, name):
    """fcfs/priority ignore the requester and the cost function."""
    return policy.choose_victim(running, running[0], name, lambda r: 0.0, max_preemptions=3)
from tokenweir.request import RequestStatus

# Block size 4, watermark and full-sequence check off: every block count below is by hand.
CRAMPED = dict(block_size=4, watermark=0.0, scheduler_reserve_full_isl=False)


def _ids(reqs):
    return [r.request_id for r in reqs]


# ---- the pure policy ----------------------------------------------------------------------
def test_choose_victim_fcfs_is_the_last_admitted():
    reqs = [make_request(f"r{i}", 4, 4, arrival=10 - i) for i in range(4)]  # arrivals reversed
    assert choose_victim(reqs, "fcfs") is reqs[-1]


def test_choose_victim_priority_is_largest_value_then_latest_arrival():
    a = make_request("a", 4, 4, arrival=0, priority=0)
    b = make_request("b", 4, 4, arrival=1, priority=5)
    c = make_request("c", 4, 4, arrival=2, priority=5)
    d = make_request("d", 4, 4, arrival=3, priority=1)
    e = make_request("e", 4, 4, arrival=4, priority=0)
    assert choose_victim([a, c, b, d, e], "priority") is c
    assert choose_victim([a, b, d, e], "priority") is b
    assert choose_victim([a, d, e], "priority") is d
    assert choose_victim([e, a], "priority") is e


# ---- fcfs in the scheduler ----------------------------------------------------------------
def _fcfs_setup():
    """a, b (prompt 4) and c (prompt 8) decode in a 7-block pool until the pool is full.
    Threshold 2 so that a re-admission of c would fit the block left after the preemption."""
    s = make_scheduler(num_blocks=8, max_model_len=28, max_num_batched_tokens=64,
                       long_prefill_token_threshold=2, max_num_partial_prefills=3, **CRAMPED)
    runner = FakeRunner()
    a, b, c = make_request("a", 4, 20), make_request("b", 4, 20), make_request("c", 8, 20)
    for r in (a, b, c):
        s.add_request(r)
    # Prefill in chunks of 2, then decode until a and b are about to need their third block.
    while a.num_tokens < 9:
        out, _ = step(s, runner)
        assert not out.preempted_req_ids
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (8, 8, 10)
    assert s.kv.num_free_blocks == 0
    assert [s.kv.num_held_blocks(x) for x in "abc"] == [2, 2, 3]
    return s, runner, a, b, c


def test_fcfs_preempts_most_recently_admitted_and_resets_it():
    s, runner, a, b, c = _fcfs_setup()
    d = make_request("d", 2, 4)
    s.add_request(d)
    outputs_before = c.output_token_ids
    assert len(outputs_before) == 3
    out, _ = step(s, runner)
    # a and b each need a third block; the tail of running (c, 3 blocks) pays for both.
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == outputs_before
    assert c.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert s.kv.num_held_blocks("c") == 0
    assert s.kv.num_free_blocks == 1  # 3 freed, 2 taken by a and b
    assert _ids(s.running) == ["a", "b"]
    assert _ids(s.waiting) == ["c", "d"]  # front of the queue, ahead of d that was waiting
    # No admission on the step that preempted, though a 2-token chunk of c (or d) would fit.
    assert not out.scheduled_new_reqs
    s.check_integrity()

    out, _ = step(s, runner)
    assert out.preempted_req_ids == set()  # reported once, on the step that preempted
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]  # admitted again, in full
    new_c = out.scheduled_new_reqs[0]
    assert new_c.token_ids == c.all_token_ids and new_c.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}

    finished = run_to_completion(s, runner)
    assert finished["c"] == expected_output(c)
    assert finished["a"] == expected_output(a)


def test_fcfs_request_that_is_itself_the_victim_waits():
    s = make_scheduler(num_blocks=3, max_model_len=8, max_num_batched_tokens=64, **CRAMPED)
    runner = FakeRunner()
    a, b = make_request("a", 3, 5), make_request("b", 4, 4)
    s.add_request(a)
    s.add_request(b)
    step(s, runner)  # a: 3 computed, b: 4 computed, one block each, pool full
    assert s.kv.num_free_blocks == 0
    out, _ = step(s, runner)  # a fits its 4th token; b needs a second block: b is the tail
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 1
    s.check_integrity()


# ---- priority in the scheduler ------------------------------------------------------------
def _priority_setup(policy):
    """a(p0) d(p1) b(p5) c(p5) admitted at step 0 (priority order), e(p0) admitted at step 1;
    7 usable blocks; at step 3 a, d, b, c all need a second block, e does not."""
    s = make_scheduler(num_blocks=8, max_model_len=28, max_num_batched_tokens=64,
                       scheduling_policy=policy, **CRAMPED)
    runner = FakeRunner()
    reqs = {rid: make_request(rid, 2, 20, arrival=t, priority=p)
            for rid, t, p in [("a", 0, 0), ("b", 1, 5), ("c", 2, 5), ("d", 3, 1)]}
    for r in reqs.values():
        s.add_request(r)
    step(s, runner)
    reqs["e"] = make_request("e", 2, 20, arrival=4, priority=0)
    s.add_request(reqs["e"])
    step(s, runner)
    out, _ = step(s, runner)
    assert not out.preempted_req_ids and len(out.num_scheduled_tokens) == 5
    return s, runner, reqs


def test_priority_preempts_lowest_priority_latest_arrival():
    s, runner, r = _priority_setup("priority")
    assert _ids(s.running) == ["a", "d", "b", "c", "e"]
    out, _ = step(s, runner)
    # a, d take the 2 free blocks; b needs one: victim is c (priority 5, later than b),
    # not the tail e (priority 0).
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "d": 1, "b": 1, "e": 1}
    assert _ids(s.running) == ["a", "d", "b", "e"]
    assert r["c"].status == RequestStatus.PREEMPTED and s.kv.num_held_blocks("c") == 0
    assert list(s.waiting) == [r["c"]]
    s.check_integrity()


def test_fcfs_on_the_same_state_preempts_the_tail():
    s, runner, r = _priority_setup("fcfs")
    assert _ids(s.running) == ["a", "b", "c", "d", "e"]
    out, _ = step(s, runner)
    # a, b take the 2 free blocks; c needs one: the tail e pays; then d needs one and is
    # itself the tail: it waits.
    assert out.preempted_req_ids == {"e", "d"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert _ids(s.waiting) == ["d", "e"]


def test_priority_self_victim_gives_up_and_later_requests_wait_this_step():
    s = make_scheduler(num_blocks=3, max_model_len=8, max_num_batched_tokens=64,
                       scheduling_policy="priority", **CRAMPED)
    runner = FakeRunner()
    x = make_request("x", 3, 5, arrival=0, priority=9)
    y = make_request("y", 2, 6, arrival=1, priority=0)
    s.add_request(x)
    step(s, runner)
    s.add_request(y)
    step(s, runner)  # x: token 4 in its block; y admitted into the last block
    assert s.kv.num_free_blocks == 0 and _ids(s.running) == ["x", "y"]
    out, _ = step(s, runner)
    # x needs a second block; the lowest priority is x itself: it goes back to waiting and
    # y, behind it in running, is not scheduled this step although it needs no block.
    assert out.preempted_req_ids == {"x"}
    assert out.num_scheduled_tokens == {}
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert x.num_output_tokens == 2
    assert s.kv.num_free_blocks == 1
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"y": 1}
    finished = run_to_completion(s, runner)
    assert finished == {"x": expected_output(x), "y": expected_output(y)}


def test_priority_victim_ahead_of_requester_does_not_skip_the_next_request():
    """Preempting a request already scheduled earlier in this step (ahead of the requester in
    `running`) must not make the scheduler skip the request after the requester."""
    s = make_scheduler(num_blocks=4, max_model_len=12, max_num_batched_tokens=64,
                       scheduling_policy="priority", **CRAMPED)
    runner = FakeRunner()
    v = make_request("v", 2, 6, arrival=0, priority=9)
    x = make_request("x", 4, 6, arrival=1, priority=0)
    y = make_request("y", 2, 6, arrival=2, priority=0)
    s.add_request(v)
    step(s, runner)
    s.add_request(x)
    s.add_request(y)
    step(s, runner)
    assert s.kv.num_free_blocks == 0 and _ids(s.running) == ["v", "x", "y"]
    out, _ = step(s, runner)
    # v is scheduled (no new block), then x needs one: victim v (priority 9) is dropped from
    # this step; y must still get its decode.
    assert out.preempted_req_ids == {"v"}
    assert out.num_scheduled_tokens == {"x": 1, "y": 1}
    assert out.total_num_scheduled_tokens == 2  # v's planned token was given back
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["x", "y"]
    assert v.status == RequestStatus.PREEMPTED and s.kv.num_held_blocks("v") == 0
    s.check_integrity()
    finished = run_to_completion(s, runner)
    assert finished == {r.request_id: expected_output(r) for r in (v, x, y)}
