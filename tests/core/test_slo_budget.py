"""The slo policy's step budget: running decodes' TPOT targets cap the step's prefill chunk.

Pure arithmetic first (the allowance, the longest chunk within a time), then the scheduler on a
scripted clock: a long prompt arriving beside a decode with a tight TPOT target is prefilled in
short chunks (probe: without the target, the same run takes full-budget chunks), a decode with
slack to spare does not shrink the chunk, and the outputs are the same either way."""

from __future__ import annotations

import math

import pytest

from tests.core.harness import FakeRunner, expected_output, make_request
from tests.core.test_slo_scheduler import SECONDS_PER_TOKEN, drive, slo_scheduler
from tokenweir.core.sched import slo
from tokenweir.core.sched.policies.slo import SLOPolicy


def test_tpot_allowance_is_the_time_bank_of_the_mean():
    # 4 tokens so far, the first at t=10, now t=10.5, target 0.2 s/token: after the next
    # token 4 gaps may take 0.8 s, 0.5 s are gone
    assert slo.tpot_allowance(0.2, 4, 10.0, 10.5) == pytest.approx(0.3)
    assert slo.tpot_allowance(0.2, 1, 10.0, 10.5) < 0  # already late


def test_prefill_tokens_within_is_the_longest_chunk_that_fits():
    p = slo.TTFTPredictor(a=0.001, c=0.01, b=1e-6)
    n = slo.prefill_tokens_within(p, 0.5, context=100, num_decodes=3, most=4096)
    step = lambda k: p.predict(k, tokens_ahead=3, computed_tokens=100)  # noqa: E731
    assert step(n) <= 0.5 < step(n + 1)
    assert slo.prefill_tokens_within(p, 100.0, 0, 0, most=256) == 256  # time to spare
    assert slo.prefill_tokens_within(p, 0.005, 0, 0, most=256) == 0  # below the fixed cost


def tight_decode_and_long_prompt(tpot_ms):
    # the chat request has its first token at t=0.016 (16 tokens at 1 ms each); the document
    # arrives just after, while it decodes
    chat = make_request("chat", 16, 20, arrival=0.0)
    chat.tpot_slo_ms = tpot_ms
    doc = make_request("doc", 3000, 2, arrival=0.017)
    return [(0.0, chat), (0.017, doc)]


def doc_chunks(log, beside_chat=False):
    """The document's prefill chunks (only those in steps that also decoded the chat one)."""
    return [counts["doc"] for _, counts in log
            if counts.get("doc", 0) > 1 and (not beside_chat or "chat" in counts)]


def test_a_tight_decode_caps_the_prefill_chunk_and_keeps_its_tpot():
    scheduler = slo_scheduler(max_num_batched_tokens=512)
    arrivals = tight_decode_and_long_prompt(tpot_ms=100.0)
    chat = arrivals[0][1]
    finished, log = drive(scheduler, FakeRunner(), arrivals)
    # 100 ms per token on a 1 ms/token clock: beside the decode, chunks of about 100 tokens
    # (at most 2 tokens' worth of time in the bank), never the budget; the full budget after
    beside = doc_chunks(log, beside_chat=True)
    assert len(beside) >= 10 and max(beside) < 200 and sum(doc_chunks(log)) == 3000
    assert max(doc_chunks(log)) == 512
    mean_tpot = (chat_finish(log) - chat.first_token_time) / (len(finished["chat"]) - 1)
    assert mean_tpot <= 0.100 + 1e-9
    # the probe: the same run without the target takes full-budget chunks and misses it
    plain = slo_scheduler(max_num_batched_tokens=512)
    plain_arrivals = tight_decode_and_long_prompt(tpot_ms=None)
    plain_finished, plain_log = drive(plain, FakeRunner(), plain_arrivals)
    assert max(doc_chunks(plain_log)) >= 500
    plain_chat = plain_arrivals[0][1]
    plain_tpot = (chat_finish(plain_log) - plain_chat.first_token_time) / 19
    assert plain_tpot > 0.100
    assert finished == plain_finished == {r.request_id: expected_output(r)
                                          for _, r in arrivals}


def chat_finish(log):
    return max(now for now, counts in log if "chat" in counts)


def test_a_decode_with_slack_to_spare_does_not_cap_the_chunk():
    scheduler = slo_scheduler(max_num_batched_tokens=512)
    arrivals = tight_decode_and_long_prompt(tpot_ms=5000.0)
    _, log = drive(scheduler, FakeRunner(), arrivals)
    assert max(doc_chunks(log)) >= 500


def test_the_prefill_always_gets_the_minimum_chunk():
    scheduler = slo_scheduler(max_num_batched_tokens=512)
    arrivals = tight_decode_and_long_prompt(tpot_ms=1.0)  # no step can keep 1 ms per token
    finished, log = drive(scheduler, FakeRunner(), arrivals)
    beside = doc_chunks(log, beside_chat=True)
    assert beside and set(beside) == {SLOPolicy.MIN_PREFILL_CHUNK}
    assert sum(doc_chunks(log)) == 3000
    assert set(finished) == {"chat", "doc"}


def test_the_config_target_applies_to_requests_without_their_own():
    scheduler = slo_scheduler(max_num_batched_tokens=512, slo_tpot_ms=100.0)
    _, log = drive(scheduler, FakeRunner(), tight_decode_and_long_prompt(tpot_ms=None))
    assert max(doc_chunks(log, beside_chat=True)) < 200
    assert math.isinf(scheduler.policy._tpot_allowance(make_request("x", 4, 4), 0.0))



def test_without_any_tpot_target_the_guard_returns_at_once(monkeypatch):
    """No config default and no request's own target: the guard asks for no allowance (the
    early return), and the run is the one the full guard gives; the probe: with one request's
    target the allowance is asked for."""
    asked = []
    original = SLOPolicy._tpot_allowance
    monkeypatch.setattr(SLOPolicy, "_tpot_allowance",
                        lambda self, r, now: asked.append(r.request_id) or original(self, r, now))
    scheduler = slo_scheduler(max_num_batched_tokens=512)
    arrivals = tight_decode_and_long_prompt(tpot_ms=None)
    finished, log = drive(scheduler, FakeRunner(), arrivals)
    assert asked == []
    monkeypatch.setattr(SLOPolicy, "_guard_tpot",  # the guard without its early return
                        SLOPolicy._cap_budget_for_tpot)
    full_finished, full_log = drive(slo_scheduler(max_num_batched_tokens=512), FakeRunner(),
                                    tight_decode_and_long_prompt(tpot_ms=None))
    assert (finished, log) == (full_finished, full_log) and asked
    asked.clear()
    monkeypatch.undo()
    monkeypatch.setattr(SLOPolicy, "_tpot_allowance",
                        lambda self, r, now: asked.append(r.request_id) or original(self, r, now))
    drive(slo_scheduler(max_num_batched_tokens=512), FakeRunner(),
          tight_decode_and_long_prompt(tpot_ms=100.0))
    assert "chat" in asked
