"""SLO policy as pure functions: slack, EDF order, the four slack-sign cases of both gates,
both stubbornness rules, and the deadline queue."""

import math

import pytest

from tokenweir.core.sched import slo
from tokenweir.core.sched.queues import make_queue
from tests.core.harness import make_request

MARGIN = 0.010


def waiter(now_slack: float, wait_slack: float = -1.0) -> slo.Waiter:
    return slo.Waiter("w", slack_if_served_now=now_slack, slack_if_it_waits=wait_slack)


def cands(*slacks: float, preempted: int = 0) -> list[slo.Candidate]:
    return [slo.Candidate(f"r{i}", s, preempted) for i, s in enumerate(slacks)]


# ---- predictor, slack, EDF ---------------------------------------------------------------
def test_predictor_counts_the_work_queued_ahead():
    p = slo.TTFTPredictor(a=0.001, c=0.02)
    assert p.predict(500) == pytest.approx(0.52)
    assert p.predict(500, tokens_ahead=1500) == pytest.approx(2.02)


def test_slack_is_time_left_minus_predicted_ttft():
    assert slo.slack(10.0, now=9.0, predicted_ttft=0.25) == pytest.approx(0.75)
    assert slo.slack(10.0, now=9.9, predicted_ttft=0.25) == pytest.approx(-0.15)
    assert slo.slack(None, now=0.0, predicted_ttft=5.0) == math.inf


def test_edf_rescuable_first_most_urgent_first_hopeless_sink():
    now = 100.0
    # (slack, deadline): two rescuable, one without a deadline, two hopeless
    keys = {"near": slo.edf_key(0.1, 100.5, now), "far": slo.edf_key(3.0, 110.0, now),
            "none": slo.edf_key(math.inf, None, now),
            "hopeless_soon": slo.edf_key(-0.5, 100.2, now),
            "hopeless_late": slo.edf_key(-2.0, 104.0, now)}
    order = sorted(keys, key=lambda name: -keys[name])
    assert order == ["near", "far", "none", "hopeless_late", "hopeless_soon"]


def test_tolerance_keeps_a_near_miss_rescuable_in_the_edf_order():
    now, predicted = 100.0, 1.0
    near_miss = slo.slack(100.95, now, predicted)  # -0.05: 5% short of its prediction
    assert slo.edf_key(near_miss, 100.95, now) < 0  # tolerance 0: hopeless, sinks
    floor = slo.hopeless_below(predicted, tolerance=0.1)
    assert floor == pytest.approx(-0.1)
    assert slo.edf_key(near_miss, 100.95, now, floor) > slo.edf_key(math.inf, None, now)
    far_miss = slo.slack(100.5, now, predicted)  # -0.5: half its prediction short
    assert slo.edf_key(far_miss, 100.5, now, floor) < 0  # still hopeless


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_tolerance_lets_a_near_miss_waiter_preempt(mode):
    near_miss = slo.Waiter("w", slack_if_served_now=-0.05, slack_if_it_waits=-2.0)
    assert slo.gate(near_miss, cands(5.0), mode, MARGIN, 1).case == slo.WAITER_HOPELESS
    tolerant = slo.Waiter("w", -0.05, -2.0, hopeless_below=-0.1)
    d = slo.gate(tolerant, cands(5.0), mode, MARGIN, 1)
    assert d.fire and d.case == slo.MARGIN_BEATEN
    # the running side's tolerance decides whether it yields outright
    running = [slo.Candidate("r0", -0.05, 0, hopeless_below=-0.1)]
    assert slo.gate(waiter(0.5), running, mode, MARGIN, 1).case == slo.MARGIN_NOT_BEATEN


def test_evaluate_applies_the_tolerance_to_the_waiter_and_the_candidates():
    predictor = slo.TTFTPredictor(a=0.001, c=0.0)  # 1000 tokens: 1 s
    waiters = [slo.WaiterView("u", deadline=10.95, owed_tokens=1000)]  # 5% short at now=10
    prefills = [slo.PrefillView("long", deadline=None, owed_tokens=4000, num_slo_preemptions=0)]
    held, _ = slo.evaluate(waiters, prefills, 10.0, predictor, 4.0, slo.CONSERVATIVE, MARGIN, 1)
    assert not held.fire and held.case == slo.WAITER_HOPELESS
    fired, who = slo.evaluate(waiters, prefills, 10.0, predictor, 4.0, slo.CONSERVATIVE,
                              MARGIN, 1, tolerance=0.1)
    assert fired.fire and fired.victim_id == "long" and who == "u"


def test_edf_key_is_finite_at_the_deadline():
    assert math.isfinite(slo.edf_key(0.0, 5.0, 5.0))


def test_deadline_queue_reorders_by_key_and_keeps_arrival_order_on_ties():
    q = make_queue("slo")
    a, b, c = (make_request(r, 4, 1, arrival=t) for r, t in (("a", 0.0), ("b", 1.0), ("c", 2.0)))
    for r in (a, b, c):
        q.add(r)
    keys = {"a": 1.0, "b": 5.0, "c": 1.0}
    q.reorder(lambda r: keys[r.request_id])
    assert [r.request_id for r in q] == ["b", "a", "c"]
    assert q.pop() is b and q.peek() is a
    q.remove(c)
    assert len(q) == 1
    with pytest.raises(ValueError):
        q.remove(c)


# ---- the gate: preconditions -------------------------------------------------------------
@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_gate_holds_without_waiter_or_candidates(mode):
    assert slo.gate(None, cands(1.0), mode, MARGIN, 1).case == slo.NO_WAITER
    assert slo.gate(waiter(0.5), [], mode, MARGIN, 1).case == slo.NO_CANDIDATE


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_gate_holds_when_waiting_meets_the_deadline(mode):
    d = slo.gate(waiter(0.5, wait_slack=0.1), cands(5.0), mode, MARGIN, 1)
    assert not d.fire and d.case == slo.NO_NEED


# ---- the four slack-sign cases, both gates ------------------------------------------------
@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_both_positive_fires_only_past_the_margin(mode):
    fired = slo.gate(waiter(0.5), cands(2.0), mode, MARGIN, 1)
    assert fired.fire and fired.case == slo.MARGIN_BEATEN and fired.victim_id == "r0"
    held = slo.gate(waiter(0.5), cands(0.505), mode, MARGIN, 1)
    assert not held.fire and held.case == slo.MARGIN_NOT_BEATEN


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_waiter_hopeless_never_fires(mode):
    d = slo.gate(waiter(-0.1), cands(5.0), mode, MARGIN, 1)
    assert not d.fire and d.case == slo.WAITER_HOPELESS


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_running_hopeless_yields_to_a_rescuable_waiter(mode):
    d = slo.gate(waiter(0.5), cands(-1.0), mode, MARGIN, 1)
    assert d.fire and d.case == slo.RUNNING_HOPELESS and d.victim_id == "r0"


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_both_hopeless_never_fires(mode):
    d = slo.gate(waiter(-0.1), cands(-1.0), mode, MARGIN, 1)
    assert not d.fire and d.case == slo.BOTH_HOPELESS


def test_conservative_must_beat_the_most_urgent_aggressive_the_least():
    # running prefills with slack 0.3 (urgent) and 5.0 (generous); the waiter has 0.5
    running = cands(0.3, 5.0)
    conservative = slo.gate(waiter(0.5), running, slo.CONSERVATIVE, MARGIN, 1)
    assert not conservative.fire and conservative.case == slo.MARGIN_NOT_BEATEN
    aggressive = slo.gate(waiter(0.5), running, slo.AGGRESSIVE, MARGIN, 1)
    assert aggressive.fire and aggressive.victim_id == "r1"  # the least urgent pays


def test_conservative_victim_is_the_least_urgent_when_it_fires():
    d = slo.gate(waiter(0.1), cands(2.0, 7.0, 3.0), slo.CONSERVATIVE, MARGIN, 1)
    assert d.fire and d.victim_id == "r1"


def test_conservative_yields_to_a_hopeless_running_request():
    d = slo.gate(waiter(0.5), cands(-0.2, 5.0), slo.CONSERVATIVE, MARGIN, 1)
    assert d.fire and d.case == slo.RUNNING_HOPELESS and d.victim_id == "r0"


def test_gate_rejects_an_unknown_mode():
    with pytest.raises(ValueError):
        slo.gate(waiter(0.5), cands(2.0), "reckless", MARGIN, 1)


# ---- stubbornness ------------------------------------------------------------------------
def test_a_request_preempted_once_is_immune():
    assert slo.gate(waiter(0.5), cands(5.0, preempted=1), slo.AGGRESSIVE, MARGIN, 1).case == \
        slo.ALL_IMMUNE
    # the immune one is skipped, the other pays
    mixed = [slo.Candidate("old", 9.0, 1), slo.Candidate("new", 4.0, 0)]
    d = slo.gate(waiter(0.5), mixed, slo.AGGRESSIVE, MARGIN, 1)
    assert d.fire and d.victim_id == "new"
    # immunity is configurable: two preemptions allowed
    assert slo.gate(waiter(0.5), cands(5.0, preempted=1), slo.AGGRESSIVE, MARGIN, 2).fire


def test_a_forward_pass_past_the_layer_fraction_refuses_the_cut():
    assert slo.may_cut_at_layer(0, 30, 0.9)
    assert slo.may_cut_at_layer(26, 30, 0.9)
    assert not slo.may_cut_at_layer(27, 30, 0.9)
    assert not slo.may_cut_at_layer(29, 30, 0.9)
    assert not slo.may_cut_at_layer(0, 30, 0.0)


def test_met_deadline():
    assert slo.met_deadline(1.0, 1.0) is True
    assert slo.met_deadline(1.1, 1.0) is False
    assert slo.met_deadline(None, 1.0) is False
    assert slo.met_deadline(1.0, None) is None


def test_predictor_quadratic_term_applies_to_the_requests_own_tokens():
    p = slo.TTFTPredictor(a=0.001, c=0.02, b=1e-7)
    assert p.predict(1000) == pytest.approx(0.001 * 1000 + 1e-7 * 1000 ** 2 + 0.02)
    assert p.predict(1000, tokens_ahead=500) == pytest.approx(1.5 + 0.1 + 0.02)


def test_predictor_charges_the_rest_of_a_prompt_its_attention_over_the_computed_part():
    p = slo.TTFTPredictor(a=0.001, c=0.02, b=1e-7)
    # the last 350 tokens of an 1883-token prompt attend to all 1883, not to 350
    rest = p.predict(350, computed_tokens=1533)
    assert rest == pytest.approx(0.001 * 350 + 1e-7 * (1883 ** 2 - 1533 ** 2) + 0.02)
    assert rest > p.predict(350) + 0.1
    # chunk by chunk the attention terms add up to the whole prompt's
    first, second = p.predict(1000) - 0.02, p.predict(883, computed_tokens=1000) - 0.02
    assert first + second == pytest.approx(p.predict(1883) - 0.02)


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_margin_beaten_holds_when_the_victim_would_then_miss(mode):
    """A waiter with 0.5 s of slack needing 1 s of service beats a prefill with 0.8 s of
    slack on the margin, but pausing it would make that prefill miss by 0.2 s."""
    needy = slo.Waiter("w", slack_if_served_now=0.5, slack_if_it_waits=-1.0, service_seconds=1.0)
    d = slo.gate(needy, cands(0.8), mode, MARGIN, 1)
    assert not d.fire and d.case == slo.VICTIM_WOULD_MISS
    assert slo.gate(needy, cands(1.2), mode, MARGIN, 1).case == slo.MARGIN_BEATEN  # can wait
    no_deadline = [slo.Candidate("r0", math.inf)]
    assert slo.gate(needy, no_deadline, mode, MARGIN, 1).case == slo.MARGIN_BEATEN


@pytest.mark.parametrize("mode", slo.SLO_GATES)
def test_tolerance_makes_can_wait_pessimistic(mode):
    """Waiting its turn leaves 0.05 s of slack on a 2 s prediction: enough at tolerance 0,
    not when the prediction may be 10% (0.2 s) short."""
    plain = slo.Waiter("w", slack_if_served_now=1.0, slack_if_it_waits=0.05)
    assert slo.gate(plain, cands(5.0), mode, MARGIN, 1).case == slo.NO_NEED
    wary = slo.Waiter("w", 1.0, 0.05, can_wait_above=0.2)
    assert slo.gate(wary, cands(5.0), mode, MARGIN, 1).fire
    predictor = slo.TTFTPredictor(a=0.001, c=0.0)
    waiters = [slo.WaiterView("u", deadline=12.05, owed_tokens=1000)]  # 1 s + 1 s of wait
    prefills = [slo.PrefillView("long", deadline=None, owed_tokens=4000, num_slo_preemptions=0)]
    args = (waiters, prefills, 10.0, predictor, 1.0, mode, MARGIN, 1)
    assert slo.evaluate(*args)[0].case == slo.NO_NEED
    assert slo.evaluate(*args, tolerance=0.1)[0].case == slo.MARGIN_BEATEN
