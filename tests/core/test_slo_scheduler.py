"""The "slo" policy inside the real scheduler, driven by the fake runner on a scripted clock:
EDF admission, the between-steps pause (and its memory fallback), immunity, the rollback of a
cut step, attainment counters. Every "survives" check comes with a probe that the mechanism
really fired."""

from __future__ import annotations

import pytest

from tests.core.harness import FakeRunner, expected_output, make_request, make_scheduler
from tokenweir.core.sched import slo
from tokenweir.core.outputs import SLO_BETWEEN_STEPS, SLO_MID_STEP
from tokenweir.request import RequestStatus

SECONDS_PER_TOKEN = 0.001  # the scripted clock: a step takes 1 ms per scheduled token


def slo_scheduler(**config):
    config.setdefault("max_num_batched_tokens", 512)
    scheduler = make_scheduler(scheduling_policy="slo", **config)
    scheduler.policy.ttft_predictor = slo.TTFTPredictor(a=SECONDS_PER_TOKEN, c=0.0)
    return scheduler


def drive(scheduler, runner, arrivals, until_idle=True, max_steps=10_000):
    """Step on the scripted clock, adding each (time, request) once its time has come.
    Returns {request id: output tokens} and the per-step log [(now, {rid: tokens})]."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    now, log, finished = 0.0, [], {}
    for _ in range(max_steps):
        while arrivals and arrivals[0][0] <= now:
            scheduler.add_request(arrivals.pop(0)[1])
        if not scheduler.has_unfinished_requests():
            if not arrivals:
                return finished, log
            now = arrivals[0][0]
            continue
        out = scheduler.schedule(now)
        now += SECONDS_PER_TOKEN * out.total_num_scheduled_tokens
        log.append((now, dict(out.num_scheduled_tokens)))
        for eco in scheduler.update_from_output(out, runner.execute(out), now):
            if eco.finish_reason is not None:
                finished[eco.request.request_id] = eco.request.output_token_ids
        scheduler.check_integrity()
    raise AssertionError("did not finish")


def long_and_urgent(urgent_slo_ms=300.0, long_slo_ms=None, urgent_arrival=1.0):
    long = make_request("long", 4000, 4, arrival=0.0)
    long.ttft_slo_ms = long_slo_ms
    urgent = make_request("urgent", 256, 4, arrival=urgent_arrival)
    urgent.ttft_slo_ms = urgent_slo_ms
    return long, urgent


def test_edf_admits_the_nearest_deadline_first():
    scheduler = slo_scheduler(max_num_seqs=1)
    reqs = []
    for rid, slo_ms in (("late", 5000.0), ("none", None), ("soon", 800.0)):
        r = make_request(rid, 64, 2)
        r.ttft_slo_ms = slo_ms
        reqs.append((0.0, r))
    _, log = drive(scheduler, FakeRunner(), reqs)
    order = []
    for _, counts in log:
        order.extend(r for r in counts if r not in order)
    assert order == ["soon", "late", "none"]


def test_fcfs_makes_the_urgent_request_wait_for_the_long_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=512)
    long, urgent = long_and_urgent()
    drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent)])
    assert urgent.first_token_time > urgent.ttft_deadline  # the head-of-line blocking


def test_between_steps_pause_admits_the_urgent_waiter_and_keeps_the_victims_work():
    scheduler = slo_scheduler()
    long, urgent = long_and_urgent()
    finished, log = drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent)])
    # probe: the pause really happened, once, and freed nothing
    assert scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS] == 1
    assert scheduler.stats.num_preemptions == 0 and long.num_preemptions == 0
    assert long.num_slo_preemptions == 1
    admit_step = next(i for i, (_, c) in enumerate(log) if "urgent" in c)
    assert "long" not in log[admit_step][1]  # paused for that step
    assert "long" in log[admit_step - 1][1] and "long" in log[admit_step + 1][1]
    assert urgent.first_token_time <= urgent.ttft_deadline
    # the long prefill never recomputed: its chunks add up to its prompt exactly once
    assert sum(c.get("long", 0) for _, c in log) == 4000 + 3
    assert finished == {"long": expected_output(long), "urgent": expected_output(urgent)}


def two_urgent_waiters(**config):
    """The long prefill, the first urgent request (it pauses long at t=1.024), and a second
    one that arrives at 2.3, seen at the step end 2.304 with 44 ms of slack: rescuable only
    by pausing long a second time. Returns (pauses, whether the second met its target)."""
    scheduler = slo_scheduler(**config)
    long, urgent = long_and_urgent()
    second = make_request("urgent2", 256, 4, arrival=2.3)
    second.ttft_slo_ms = 300.0
    drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent), (2.3, second)])
    assert urgent.first_token_time <= urgent.ttft_deadline
    return (scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS],
            second.first_token_time <= second.ttft_deadline)


def test_a_paused_request_is_immune_to_a_second_pause():
    assert two_urgent_waiters(slo_max_preemptions=2) == (2, True)  # probe: the second pause
    assert two_urgent_waiters(slo_max_preemptions=1) == (1, False)  # immunity had a price


def test_pauses_have_their_own_cap_when_one_is_set():
    """slo_max_pauses: pauses count against it alone (cuts against slo_max_preemptions)."""
    assert two_urgent_waiters(slo_max_preemptions=1, slo_max_pauses=2) == (2, True)
    assert two_urgent_waiters(slo_max_preemptions=3, slo_max_pauses=1) == (1, False)
    scheduler = slo_scheduler(slo_max_pauses=5)
    request = make_request("r", 512, 4)
    request.num_slo_preemptions, request.num_slo_pauses = 3, 2  # 2 pauses, 1 cut
    policy = scheduler.policy
    assert policy._prefill_view(scheduler, request, pause=True).num_slo_preemptions == 2
    assert policy._prefill_view(scheduler, request, pause=False).num_slo_preemptions == 1
    assert (policy._cap(pause=True), policy._cap(pause=False)) == (5, 3)
    default = slo_scheduler().policy  # without: both count together against one cap
    assert default._prefill_view(scheduler, request, pause=True).num_slo_preemptions == 3
    assert (default._cap(pause=True), default._cap(pause=False)) == (3, 3)


def test_no_pause_for_a_hopeless_waiter_or_one_that_can_wait():
    for slo_ms in (100.0, 60_000.0):  # 256 tokens need 256 ms; 60 s is plenty to wait
        scheduler = slo_scheduler()
        long, urgent = long_and_urgent(urgent_slo_ms=slo_ms)
        drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent)])
        assert scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS] == 0


def test_hopeless_tolerance_serves_a_near_miss_before_the_long_prefill():
    """256 tokens need 256 ms: a 240 ms target is 6% short of the prediction. Sign of the
    slack: hopeless, it waits for the whole 4000-token prefill. A 10% tolerance: rescuable,
    the long prefill is paused and the near miss is served at once."""
    urgent_first_token = {}
    for tolerance in (0.0, 0.1):
        scheduler = slo_scheduler(slo_hopeless_tolerance=tolerance)
        long, urgent = long_and_urgent(urgent_slo_ms=240.0, urgent_arrival=1.024)
        drive(scheduler, FakeRunner(), [(0.0, long), (1.024, urgent)])  # at a step's end
        pauses = scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS]
        assert pauses == (1 if tolerance else 0)  # probe: the tolerance changed the decision
        urgent_first_token[tolerance] = urgent.first_token_time - urgent.arrival_time
        assert long.first_token_time is not None
    assert urgent_first_token[0.0] > 3.0  # behind the rest of the long prefill
    assert urgent_first_token[0.1] < 0.6  # at most one 512-token step late, then its own


def test_conservative_gate_spares_an_urgent_prefill_that_aggressive_pauses():
    # Two prefills share the budget (256 tokens each per step): "mid" has a tight target
    # (slack ~0.1 s when the urgent one arrives at t=1.024), "long" none. The urgent waiter
    # (slack 0.044 s) beats "long" but not "mid" by the 100 ms margin.
    results = {}
    for gate in slo.SLO_GATES:
        scheduler = slo_scheduler(slo_preempt_gate=gate, slo_margin_ms=100.0,
                                  max_num_partial_prefills=2, long_prefill_token_threshold=256,
                                  slo_isolate_at_risk_prefill=False)  # "mid" would run alone
        long, urgent = long_and_urgent()
        mid = make_request("mid", 2000, 4, arrival=0.0)
        mid.ttft_slo_ms = 2612.0
        drive(scheduler, FakeRunner(), [(0.0, long), (0.0, mid), (1.0, urgent)])
        results[gate] = (scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS],
                         long.num_slo_preemptions, mid.num_slo_preemptions)
    assert results == {"conservative": (0, 0, 0), "aggressive": (1, 1, 0)}


def test_a_prefill_at_risk_runs_with_decodes_only():
    """Two prefills may share the budget (256 tokens each). "tight" needs ~2 s and has 2.5 s:
    with isolation on it runs alone (decodes allowed), "roomy" (no deadline) waits; off, they
    share every step and "tight" misses."""
    outcome = {}
    for isolate in (True, False):
        scheduler = slo_scheduler(max_num_partial_prefills=2, long_prefill_token_threshold=256,
                                  slo_isolate_at_risk_prefill=isolate)
        tight = make_request("tight", 2000, 4, arrival=0.0)
        tight.ttft_slo_ms = 2500.0
        roomy = make_request("roomy", 2000, 4, arrival=0.0)
        decoder = make_request("decoder", 16, 40, arrival=0.0)
        _, log = drive(scheduler, FakeRunner(), [(0.0, decoder), (0.01, tight), (0.01, roomy)])
        tight_steps = [c for _, c in log if c.get("tight", 0) > 1]
        # probe: whether the other prefill ever shared a step with "tight"'s chunks
        shared = sum(1 for c in tight_steps if c.get("roomy", 0) > 1)
        with_decode = sum(1 for c in tight_steps if c.get("decoder") == 1)
        outcome[isolate] = (shared, with_decode > 0, tight.first_token_time <= tight.ttft_deadline)
    assert outcome[True] == (0, True, True)
    assert outcome[False][0] > 0 and outcome[False][2] is False


def test_memory_blocked_waiter_gets_the_victims_blocks():
    # 4000 + 4 tokens need 251 blocks of 16; a pool of 262 leaves 10, the urgent one needs 17
    scheduler = slo_scheduler(num_blocks=262, enable_prefix_caching=True)
    # at t=3.584 the long prefill holds 240 blocks and owes 416 tokens
    long, urgent = long_and_urgent(urgent_slo_ms=400.0, urgent_arrival=3.5)
    finished, _ = drive(scheduler, FakeRunner(), [(0.0, long), (3.5, urgent)])
    assert scheduler.stats.preemptions_by_cause[SLO_BETWEEN_STEPS] == 1
    assert long.num_preemptions == 1  # freed and re-queued, not just paused
    # (the pool cannot hold both whole: memory preemptions may follow; outputs must not care)
    assert urgent.first_token_time <= urgent.ttft_deadline
    assert finished == {"long": expected_output(long), "urgent": expected_output(urgent)}


def cut_execute(runner: FakeRunner, out):
    """What the real runner does when a step is cut at a layer: it takes in the step's state
    updates (new requests, blocks, forgotten ids) but advances nothing and samples nothing."""
    before_computed, before_known = dict(runner.computed), dict(runner.known)
    runner.execute(out)  # takes in the updates; then undo its advance and its samples
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    for rid in out.num_scheduled_tokens:
        if rid in new:
            runner.computed[rid] = new[rid].num_computed_tokens
            runner.known[rid] = len(new[rid].token_ids)
        else:
            runner.computed[rid] = before_computed[rid]
            runner.known[rid] = before_known[rid]


def test_roll_back_cut_step_is_as_if_the_step_never_ran():
    scheduler = make_scheduler(scheduling_policy="slo", max_num_batched_tokens=512,
                               enable_prefix_caching=True)
    runner = FakeRunner()
    long = make_request("long", 2048, 4)
    decoder = make_request("dec", 8, 6)
    for r in (decoder, long):
        scheduler.add_request(r)
    for _ in range(3):  # dec decodes, long prefills
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
    computed = {r.request_id: r.num_computed_tokens for r in (long, decoder)}
    outputs = {r.request_id: list(r.output_token_ids) for r in (long, decoder)}
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["long"] > 1 and "dec" in out.num_scheduled_tokens
    cut_execute(runner, out)
    scheduler.roll_back_cut_step(out, "long", layers_run=10, num_layers=30)
    # probe: the cut was recorded; the victim was freed and re-queued
    assert scheduler.stats.preemptions_by_cause[SLO_MID_STEP] == 1
    assert scheduler.stats.slo_wasted_layer_tokens == out.total_num_scheduled_tokens * 10
    assert long.status == RequestStatus.PREEMPTED and long.num_computed_tokens == 0
    assert long.num_slo_preemptions == 1
    # nobody else advanced or sampled
    assert decoder.num_computed_tokens == computed["dec"]
    assert decoder.output_token_ids == outputs["dec"]
    scheduler.check_integrity()
    finished = {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for eco in scheduler.update_from_output(out, runner.execute(out)):
            if eco.finish_reason:
                finished[eco.request.request_id] = eco.request.output_token_ids
        scheduler.check_integrity()
    assert finished == {"long": expected_output(long), "dec": expected_output(decoder)}
    assert long.num_cached_tokens >= 0
    # prefix caching gave the victim back the full blocks it had computed before the cut
    assert scheduler.kv.prefix_stats.hits >= computed["long"] // 16 * 16


def test_a_cut_victim_is_predicted_from_what_it_left_in_the_prefix_cache():
    """A victim cut after 1024 of its 1938 tokens re-queues with 0 computed, but its 64 full
    blocks stay in the prefix cache: its predicted TTFT is the rest's, not the whole prompt's
    (which would call it hopeless and sink it behind every generous request)."""
    predicted = {}
    for caching in (True, False):
        scheduler = make_scheduler(scheduling_policy="slo", max_num_batched_tokens=512,
                                   enable_prefix_caching=caching)
        scheduler.policy.ttft_predictor = slo.TTFTPredictor(a=0.001, c=0.0, b=1e-7)
        runner = FakeRunner()
        victim = make_request("victim", 1938, 4)
        scheduler.add_request(victim)
        for _ in range(2):
            out = scheduler.schedule()
            scheduler.update_from_output(out, runner.execute(out))
        out = scheduler.schedule()
        cut_execute(runner, out)
        scheduler.roll_back_cut_step(out, "victim", layers_run=10, num_layers=30)
        assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        predicted[caching] = scheduler.policy.predicted_ttft(scheduler, victim)
        if caching:  # probe: admission really finds those 1024 tokens again
            out = scheduler.schedule()
            assert victim.num_computed_tokens == 1024 and out.num_scheduled_tokens["victim"] == 512
    p = scheduler.policy.ttft_predictor
    assert predicted[True] == pytest.approx(p.predict(914, computed_tokens=1024))
    assert predicted[False] == pytest.approx(p.predict(1938))


def test_attainment_is_counted_per_class():
    scheduler = slo_scheduler()
    long, urgent = long_and_urgent()
    urgent.priority = 1
    drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent)])
    assert scheduler.stats.slo_attainment == {"1": [1, 0]}  # long has no target: not counted


def test_random_slo_runs_with_cuts_keep_invariants_and_outputs():
    """Seeded random arrivals with tight and loose targets, a cramped pool, prefix caching,
    and random mid-step cuts: integrity after every step, every output as if never cut."""
    import random

    rng = random.Random(7)
    for gate in slo.SLO_GATES:
        scheduler = slo_scheduler(num_blocks=300, enable_prefix_caching=True,
                                  slo_preempt_gate=gate, max_num_batched_tokens=256)
        runner = FakeRunner()
        pending = []
        for i in range(40):
            r = make_request(f"r{i}", rng.randint(8, 1500), rng.randint(1, 8),
                             arrival=rng.uniform(0, 20))
            r.ttft_slo_ms = rng.choice([None, 300.0, 2000.0, 10_000.0])
            pending.append(r)
        pending.sort(key=lambda r: r.arrival_time)
        now, finished, cuts = 0.0, {}, 0
        while pending or scheduler.has_unfinished_requests():
            while pending and pending[0].arrival_time <= now:
                scheduler.add_request(pending.pop(0))
            if not scheduler.has_unfinished_requests():
                now = pending[0].arrival_time
                continue
            out = scheduler.schedule(now)
            now += SECONDS_PER_TOKEN * out.total_num_scheduled_tokens + 1e-4
            prefills = [r for r, n in out.num_scheduled_tokens.items() if n > 1]
            if prefills and rng.random() < 0.2:
                cut_execute(runner, out)
                scheduler.roll_back_cut_step(out, rng.choice(prefills), 3, 30)
                cuts += 1
            else:
                for eco in scheduler.update_from_output(out, runner.execute(out), now):
                    if eco.finish_reason:
                        finished[eco.request.request_id] = eco.request
            scheduler.check_integrity()
        assert cuts > 0 and scheduler.stats.preemptions_by_cause[SLO_MID_STEP] > 0
        assert len(finished) == 40
        for request in finished.values():
            assert request.output_token_ids == expected_output(request)


def test_configured_quadratic_ttft_term_reaches_the_predictor():
    scheduler = make_scheduler(scheduling_policy="slo", slo_ttft_a_ms_per_token=2.0,
                               slo_ttft_b_us_per_token2=1.0, slo_ttft_c_ms=50.0)
    # 1000 tokens: 2 ms * 1000 + 1 us * 1000^2 + 50 ms = 3.05 s (the line alone: 2.05 s)
    assert abs(scheduler.policy.ttft_predictor.predict(1000) - 3.05) < 1e-9
