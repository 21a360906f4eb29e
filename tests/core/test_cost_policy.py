"""The cost victim policy: least work lost (unshared computed tokens, or the swap copies),
ties by priority then latest arrival; immunity after max_preemptions; nobody starves."""

from __future__ import annotations

import random

import pytest

from tests.core.harness import (FakeRunner, KVContentRunner, expected_output, make_prompt_request,
                                make_request, make_scheduler, run_to_completion, step)
from tokenweir.core.sched import policy

CRAMPED = dict(block_size=4, watermark=0.0, scheduler_reserve_full_isl=False,
               max_num_batched_tokens=64)


def _cost_victim(running, requester, costs, max_preemptions=3):
    cost = dict(zip((r.request_id for r in running), costs))
    return policy.choose_victim(running, requester, "cost", lambda r: cost[r.request_id],
                                max_preemptions)


def _req(rid, arrival=0.0, priority=0, preempted=0):
    r = make_request(rid, 4, 4, arrival=arrival, priority=priority)
    r.num_preemptions = preempted
    return r


# ---- the pure function ---------------------------------------------------------------------
def test_cost_picks_least_work_lost_wherever_it_runs():
    reqs = [_req(f"r{i}", arrival=i) for i in range(4)]
    assert _cost_victim(reqs, reqs[0], [5.0, 1.0, 3.0, 2.0]) is reqs[1]
    assert _cost_victim(reqs, reqs[3], [5.0, 4.0, 3.0, 2.0]) is reqs[3]  # the requester itself


def test_cost_ties_go_to_lowest_priority_then_latest_arrival():
    a = _req("a", arrival=0, priority=1)
    b = _req("b", arrival=1, priority=2)
    c = _req("c", arrival=2, priority=2)
    d = _req("d", arrival=3, priority=0)
    assert _cost_victim([a, b, c, d], a, [1.0] * 4) is c  # priority 2 (lowest), later arrival
    assert _cost_victim([a, c, b, d], a, [1.0] * 4) is c  # order in `running` does not matter
    assert _cost_victim([a, b, d], a, [1.0] * 3) is b
    assert _cost_victim([a, b, c, d], a, [1.0, 1.0, 2.0, 1.0]) is b  # cost first


def test_immune_requests_are_never_chosen_while_another_candidate_exists():
    cheap_immune = _req("immune", arrival=5, preempted=3)
    other = _req("other", arrival=1)
    requester = _req("requester", arrival=0)
    running = [requester, other, cheap_immune]
    assert _cost_victim(running, requester, [9.0, 5.0, 0.0]) is other
    # Probe: one preemption fewer and it is the victim.
    cheap_immune.num_preemptions = 2
    assert _cost_victim(running, requester, [9.0, 5.0, 0.0]) is cheap_immune


def test_an_immune_requester_does_not_give_way_while_others_can():
    requester = _req("requester", preempted=3)
    other = _req("other")
    assert _cost_victim([requester, other], requester, [1.0, 9.0]) is other
    requester.num_preemptions = 2  # not immune: it is the cheapest and gives way
    assert _cost_victim([requester, other], requester, [1.0, 9.0]) is requester


def test_when_everyone_else_is_immune_the_requester_gives_way():
    requester = _req("requester")
    others = [_req(f"o{i}", preempted=3) for i in range(3)]
    assert _cost_victim([*others, requester], requester, [0.0, 0.0, 0.0, 9.0]) is requester
    requester.num_preemptions = 3
    assert _cost_victim([*others, requester], requester, [0.0, 0.0, 0.0, 9.0]) is requester


# ---- in the scheduler ----------------------------------------------------------------------
def _four(max_preemptions, victim_policy="cost"):
    """5 usable blocks; r0 (prompt 2), r1 (2), r2 (5), r3 (3). r0 and r1 tie on cost at step 3;
    r0 arrived last of the two."""
    s = make_scheduler(num_blocks=6, max_model_len=20, preemption_policy=victim_policy,
                       max_preemptions=max_preemptions, **CRAMPED)
    reqs = [make_request("r0", 2, 5, arrival=1.0), make_request("r1", 2, 3, arrival=0.0),
            make_request("r2", 5, 6, arrival=2.0), make_request("r3", 3, 8, arrival=3.0)]
    for r in reqs:
        s.add_request(r)
    return s, FakeRunner(), reqs


def _preempted_per_step(s, runner, reqs):
    victims = []
    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        s.check_integrity()
        victims.append(sorted(out.preempted_req_ids))
    for r in reqs:
        assert r.output_token_ids == expected_output(r)
    return victims


def test_cost_policy_preempts_least_computed_not_the_tail():
    s, runner, reqs = _four(max_preemptions=3)
    victims = _preempted_per_step(s, runner, reqs)
    # Step 3: r3 needs a block; computed: r0 3, r1 3, r2 7, r3 4 -> r0 (tie with r1, later).
    assert victims[2] == ["r0"]
    s, runner, reqs = _four(max_preemptions=3, victim_policy="fcfs")
    assert _preempted_per_step(s, runner, reqs)[2] == ["r3"]  # probe: fcfs takes the tail


def test_immunity_scenario():
    s, runner, reqs = _four(max_preemptions=1)
    victims = _preempted_per_step(s, runner, reqs)
    # Step 5: r2 needs a block; r2 has 8 computed, r3 6, r0 4 but r0 was preempted once
    # (immune at max_preemptions=1): r3 pays.
    assert victims[2] == ["r0"] and victims[4] == ["r3"]
    assert [r.num_preemptions for r in reqs] == [1, 0, 0, 1]
    # Probe: with max_preemptions=2 the same step takes r0 again.
    s, runner, reqs = _four(max_preemptions=2)
    victims = _preempted_per_step(s, runner, reqs)
    assert victims[2] == ["r0"] and victims[4] == ["r0"]
    assert reqs[0].num_preemptions == 2


def test_immune_requester_is_not_preempted_by_its_own_allocation():
    """r1, preempted once (immune at max_preemptions=1), needs a block at step 6 and is the
    cheapest (8 computed vs r2's 12): r2 pays, r1 is not preempted a second time."""
    s = make_scheduler(num_blocks=7, max_model_len=24, preemption_policy="cost",
                       max_preemptions=1, **CRAMPED)
    reqs = [make_request("r0", 7, 2), make_request("r1", 5, 10), make_request("r2", 8, 8),
            make_request("r3", 5, 9)]
    for r in reqs:
        s.add_request(r)
    victims = _preempted_per_step(s, FakeRunner(), reqs)
    assert victims[1] == ["r1"]  # step 2: r1 (5 computed) is the cheapest
    assert victims[5] == ["r2"]  # step 6: not r1 again
    assert reqs[1].num_preemptions == 1


@pytest.mark.parametrize("mode,victim", [("recompute", "z"), ("swap", "z")])
def test_cost_is_unshared_tokens_for_recompute_and_blocks_for_swap(mode, victim):
    """x (P Q + 2) runs; then y (6 fresh tokens) and z (P Q + 1, hitting x's two blocks).
    When x needs its fourth block: y has 7 computed in 2 blocks, z 10 computed in 3 blocks of
    which 8 tokens are shared with x. Recompute loses y 7, z 2: z. Swap copies y 2, z 1 (its
    two blocks shared with x stay held on the device): z."""
    s = make_scheduler(num_blocks=7, max_model_len=24, preemption_policy="cost",
                       preemption_mode=mode, num_host_blocks=40, enable_prefix_caching=True,
                       **CRAMPED)
    runner = KVContentRunner(s.kv.pool, 4)
    pq = [11, 12, 13, 14, 21, 22, 23, 24]
    x = make_prompt_request("x", pq + [0, 1], 12, arrival=0.0)
    y = make_prompt_request("y", [150, 151, 152, 153, 154, 155], 11, arrival=1.0)
    z = make_prompt_request("z", pq + [200], 11, arrival=2.0)
    s.add_request(x)
    step(s, runner)
    s.add_request(y)
    s.add_request(z)
    while not s.stats.num_preemptions:
        state = {r.request_id: (r.num_computed_tokens, s.kv.num_shared_tokens(r),
                                s.kv.num_held_blocks(r.request_id)) for r in (x, y, z)}
        out, _ = step(s, runner)
    assert state == {"x": (12, 8, 3), "y": (7, 0, 2), "z": (10, 8, 3)}
    assert out.preempted_req_ids == {victim}
    assert s.stats.num_swapped_out == (mode == "swap")
    run_to_completion(s, runner)
    for r in (x, y, z):
        assert r.output_token_ids == expected_output(r)


# ---- nobody starves -----------------------------------------------------------------------
class _VictimSpy:
    """Wraps policy.choose_victim to check immunity on every call and count when it mattered."""

    def __init__(self, monkeypatch, max_preemptions):
        self.max = max_preemptions
        self.calls = self.immunity_mattered = 0
        self._orig = policy.choose_victim
        monkeypatch.setattr(policy, "choose_victim", self)

    def __call__(self, running, requester, name, cost_of, max_preemptions):
        victim = self._orig(running, requester, name, cost_of, max_preemptions)
        self.calls += 1
        non_immune = [r for r in running if r.num_preemptions < self.max]
        if non_immune:
            assert victim in non_immune, f"immune {victim.request_id} chosen"
            cheapest = min(running, key=cost_of)
            self.immunity_mattered += cheapest.num_preemptions >= self.max and \
                cost_of(cheapest) < cost_of(victim)
        else:
            assert victim is requester
        return victim


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_cramped_random_workload_finishes_under_cost_policy(monkeypatch, mode):
    spy = _VictimSpy(monkeypatch, max_preemptions=2)
    rng = random.Random(7)
    s = make_scheduler(num_blocks=1 + 16, max_model_len=64, preemption_policy="cost",
                       preemption_mode=mode, max_preemptions=2, num_host_blocks=12,
                       enable_prefix_caching=True, long_prefill_token_threshold=16,
                       max_num_partial_prefills=2, **CRAMPED)
    runner = KVContentRunner(s.kv.pool, 4)
    prefixes = [[rng.randrange(3, 999) for _ in range(12)] for _ in range(3)]
    reqs = []
    for i in range(60):
        prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + \
            [rng.randrange(3, 999) for _ in range(rng.randint(1, 20))]
        reqs.append(make_prompt_request(f"q{i}", prompt, rng.randint(1, 64 - len(prompt)),
                                        arrival=float(i), priority=rng.randint(0, 2)))
    pending = list(reqs)
    steps = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                s.add_request(pending.pop(0))
        step(s, runner)
        s.check_integrity()
        steps += 1
        assert steps < 5000, "a request starved"
    assert not s.requests
    for r in reqs:
        assert r.is_finished and r.output_token_ids == expected_output(r), r.request_id
    # Probes: the pool was cramped, immunity changed some choice, the mode did its thing.
    assert s.stats.num_preemptions > 0 and spy.calls > 0
    assert spy.immunity_mattered > 0
    assert max(r.num_preemptions for r in reqs) >= 2
    if mode != "recompute":
        assert s.stats.num_swapped_out > 0
    if mode != "swap":
        assert s.stats.recomputed_tokens > 0
    assert s.kv.prefix_stats.hits > 0
