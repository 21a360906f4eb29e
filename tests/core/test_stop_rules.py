"""Stop rules in update_from_output, finishing, and aborts."""

from __future__ import annotations

import pickle

from tests.core.harness import (EOS, FakeRunner, expected_output, make_request, make_scheduler,
                                run_to_completion, step)
from tokenweir.core.outputs import ModelRunnerOutput
from tokenweir.request import Request, RequestStatus, SamplingParams

T = 7  # an ordinary token: not EOS, not a stop token


def _feed(s, tokens: dict[str, int]):
    """One step in which every scheduled request samples the token given for it."""
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == set(tokens), (out.num_scheduled_tokens, tokens)
    sampled = {rid: [tok] for rid, tok in tokens.items()}
    return out, {o.request.request_id: o for o in
                 s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))}


def _run_tokens(req, tokens, s=None):
    """Feed `tokens` to `req` one step at a time; return (statuses after each, last outputs)."""
    s = s or make_scheduler()
    s.add_request(req)
    statuses, last = [], None
    for tok in tokens:
        _, outs = _feed(s, {req.request_id: tok})
        last = outs[req.request_id]
        statuses.append(req.status)
        if req.is_finished:
            break
    return statuses, last


def test_eos_stops():
    r = make_request("r", 4, 10)
    statuses, last = _run_tokens(r, [T, T, EOS, T])
    assert statuses[-1] == RequestStatus.FINISHED_STOPPED and len(statuses) == 3
    assert last.finish_reason == "stop" and last.new_token_ids == [EOS]
    assert r.output_token_ids == [T, T, EOS]
    assert r.stop_reason is None


def test_ignore_eos_does_not_stop():
    r = make_request("r", 4, 5, ignore_eos=True)
    statuses, last = _run_tokens(r, [T, EOS, EOS, T, T, T])
    assert statuses[:4] == [RequestStatus.RUNNING] * 4
    assert r.output_token_ids == [T, EOS, EOS, T, T] and last.finish_reason == "length"


def test_min_tokens_delays_eos():
    r = make_request("r", 4, 10, min_tokens=3)
    statuses, last = _run_tokens(r, [EOS, EOS, EOS, T])
    # EOS as output 1 and 2 does not stop; as output 3 (== min_tokens) it does.
    assert statuses == [RequestStatus.RUNNING, RequestStatus.RUNNING,
                        RequestStatus.FINISHED_STOPPED]
    assert r.output_token_ids == [EOS, EOS, EOS] and last.finish_reason == "stop"


def test_min_tokens_delays_stop_token_ids_too():
    r = make_request("r", 4, 10, min_tokens=2, stop_token_ids=[42])
    statuses, _ = _run_tokens(r, [42, 42, T])
    assert statuses == [RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED]
    assert r.stop_reason == 42


def test_stop_token_ids_stop_with_stop_reason():
    r = make_request("r", 4, 10, stop_token_ids=[42, 43])
    statuses, last = _run_tokens(r, [T, 43, T])
    assert statuses == [RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED]
    assert r.stop_reason == 43 and last.finish_reason == "stop"
    assert r.output_token_ids == [T, 43]


def test_max_tokens_finishes_with_length():
    r = make_request("r", 4, 3)
    statuses, last = _run_tokens(r, [T, T, T, T])
    assert statuses == [RequestStatus.RUNNING, RequestStatus.RUNNING,
                        RequestStatus.FINISHED_LENGTH_CAPPED]
    assert last.finish_reason == "length" and r.num_output_tokens == 3


def test_length_cap_is_hard_even_under_min_tokens():
    """Request.max_tokens is capped to fit max_model_len and may be below min_tokens: the
    length cap still ends the request (vLLM checks length first)."""
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=5)
    r = Request(request_id="r", prompt_token_ids=[5] * 13, sampling_params=params,
                max_tokens=3, eos_token_ids=frozenset({EOS}))
    s = make_scheduler(max_model_len=16)
    statuses, last = _run_tokens(r, [T] * 6, s)
    assert statuses[-1] == RequestStatus.FINISHED_LENGTH_CAPPED and len(statuses) == 3
    assert r.num_tokens == 16 and last.finish_reason == "length"


def test_finished_requests_free_blocks_and_are_reported_next_step():
    s = make_scheduler(num_blocks=50, block_size=4, max_model_len=64)
    a, b = make_request("a", 6, 2), make_request("b", 6, 10)
    s.add_request(a)
    s.add_request(b)
    free0 = s.kv.num_free_blocks
    _feed(s, {"a": T, "b": T})
    out, outs = _feed(s, {"a": T, "b": T})  # a reaches max_tokens
    assert outs["a"].finish_reason == "length" and a.status.is_finished
    assert out.finished_req_ids == set()  # not before it finished
    assert s.kv.num_held_blocks("a") == 0
    assert s.kv.num_free_blocks == free0 - s.kv.num_held_blocks("b")
    assert "a" not in s.requests and s.running == [b]
    out, _ = _feed(s, {"b": T})
    assert out.finished_req_ids == {"a"} and "a" not in out.num_scheduled_tokens
    out, _ = _feed(s, {"b": T})
    assert out.finished_req_ids == set()  # reported once
    s.check_integrity()


def _abort_scenario(abort_id):
    """a, b run and c waits (max_num_seqs=2); abort one of them after two steps."""
    s = make_scheduler(num_blocks=50, block_size=4, max_model_len=64, max_num_seqs=2)
    runner = FakeRunner()
    reqs = {rid: make_request(rid, 6, 8) for rid in "abc"}
    for r in reqs.values():
        s.add_request(r)
    step(s, runner)
    step(s, runner)
    return s, runner, reqs


def test_abort_from_running_frees_blocks_and_loses_nothing_else():
    s, runner, reqs = _abort_scenario("a")
    a, b, c = reqs["a"], reqs["b"], reqs["c"]
    assert a.status == RequestStatus.RUNNING and s.kv.num_held_blocks("a") == 2
    b_state = (b.num_computed_tokens, list(b.all_token_ids), s.kv.block_ids("b"))
    free_before = s.kv.num_free_blocks
    s.finish_requests(["a"])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert s.kv.num_held_blocks("a") == 0 and s.kv.num_free_blocks == free_before + 2
    assert (b.num_computed_tokens, b.all_token_ids, s.kv.block_ids("b")) == b_state
    assert list(s.waiting) == [c] and s.running == [b]
    s.check_integrity()
    out, _ = step(s, runner)
    assert out.finished_req_ids == {"a"} and "c" in out.num_scheduled_tokens
    finished = run_to_completion(s, runner)
    assert finished == {"b": expected_output(b), "c": expected_output(c)}


def test_abort_from_waiting_and_unknown_ids_are_harmless():
    s, runner, reqs = _abort_scenario("c")
    c = reqs["c"]
    assert c.status == RequestStatus.WAITING and s.kv.num_held_blocks("c") == 0
    free_before = s.kv.num_free_blocks
    s.finish_requests(["c", "nope", "c"])
    assert c.status == RequestStatus.FINISHED_ABORTED and len(s.waiting) == 0
    assert s.kv.num_free_blocks == free_before
    s.check_integrity()
    out, _ = step(s, runner)
    assert out.finished_req_ids == {"c"} and set(out.num_scheduled_tokens) == {"a", "b"}
    finished = run_to_completion(s, runner)
    assert finished == {r: expected_output(reqs[r]) for r in "ab"}


def test_abort_of_a_preempted_request():
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=8, watermark=0.0,
                       scheduler_reserve_full_isl=False)
    runner = FakeRunner()
    a, b = make_request("a", 3, 5), make_request("b", 4, 4)
    s.add_request(a)
    s.add_request(b)
    step(s, runner)
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    s.finish_requests(["b"])
    assert b.status == RequestStatus.FINISHED_ABORTED and len(s.waiting) == 0
    s.check_integrity()
    assert run_to_completion(s, runner) == {"a": expected_output(a)}


def test_abort_between_schedule_and_update_is_skipped():
    s = make_scheduler()
    runner = FakeRunner()
    a, b = make_request("a", 4, 5), make_request("b", 4, 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    result = runner.execute(out)
    s.finish_requests(["a"])
    outs = s.update_from_output(out, result)
    assert [o.request.request_id for o in outs] == ["b"]
    assert a.num_output_tokens == 0 and a.status == RequestStatus.FINISHED_ABORTED
    s.check_integrity()


def test_an_output_without_its_requests_is_updated_by_id():
    """An output built elsewhere, or pickled (a tensor-parallel worker's copy), carries no
    Request objects: the update finds the scheduled requests by id, skipping the aborted."""
    s, runner = make_scheduler(), FakeRunner()
    a, b = make_request("a", 4, 5), make_request("b", 4, 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled_requests == [a, b]
    copy = pickle.loads(pickle.dumps(out))
    assert copy.scheduled_requests is None
    assert copy.num_scheduled_tokens == out.num_scheduled_tokens
    result = runner.execute(out)
    s.finish_requests(["a"])
    outs = s.update_from_output(copy, result)
    assert [o.request.request_id for o in outs] == ["b"] and b.num_computed_tokens == 4
    assert a.num_output_tokens == 0 and b.num_output_tokens == 1
    s.check_integrity()


def test_eos_on_the_last_allowed_token_reports_stop():
    r = make_request("r", 4, 2)
    statuses, last = _run_tokens(r, [T, EOS])
    assert statuses[-1] == RequestStatus.FINISHED_STOPPED and last.finish_reason == "stop"
