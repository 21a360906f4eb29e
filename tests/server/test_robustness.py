"""Issue 14, server half: one bad request never hurts another. Every reproduction runs against
a real `tokenweir serve` subprocess beside a neighbouring streamed completion that must finish
in full (tests/server/probes.py); shutdown runs get servers of their own."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

import probes  # tests/server/probes.py (pytest puts this folder on sys.path)
import tiny_serve_model  # tests/tiny_serve_model.py

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# name -> (status, param) the server must answer, for every probe of probes.BAD_REQUESTS
EXPECTED = {
    "lone surrogate prompt": (400, "prompt"),
    "JSON nested 100,000 deep": (400, None),
    "prompt nested 5,000 deep": (400, None),
    "chat text part 5": (400, "messages"),
    "stop_token_ids ['a'] + min_tokens 2": (400, "stop_token_ids"),
    "top_k 1e400": (400, "top_k"),
    "best_of 3 streamed": (400, "best_of"),
    "logit_bias outside the vocabulary": (400, "logit_bias"),
    "logit_bias 101": (400, "logit_bias"),
    "response_format bad schema": (400, "response_format"),
    "tools": (400, "tools"),
    "tool_choice": (400, "tool_choice"),
    "suffix": (400, "suffix"),
    "presence_penalty 2.5": (400, "presence_penalty"),
    "repetition_penalty 0": (400, "repetition_penalty"),
    "frequency_penalty 'x'": (400, "frequency_penalty"),
    "n 300": (400, "n"),
    "10 MB body, unknown field": (413, None),
}


# The module's server runs tests/tiny_serve_model.py (SmolLM2-135M's tokenizer and template on
# a tiny random-weight Llama, answering as smollm2-135m): what is probed is the server's
# handling of requests. Its neighbours stream NEIGHBOUR_TOKENS tokens, ~10x SmolLM2's 24, so
# that they are in flight about as long on its ~1/30-cost steps. The shutdown tests, whose
# streams must outlast a signal, keep servers of SmolLM2.
NEIGHBOUR_TOKENS = 240


@pytest.fixture(scope="module")
def server():
    proc, base = probes.start_server(ROOT, *tiny_serve_model.SERVE_ARGS,
                                     model=tiny_serve_model.path())
    try:
        yield {"base": base, "proc": proc}
    finally:
        probes.stop_server(proc)


@pytest.fixture(scope="module")
def bad_answers(server):
    """Every probe of probes.BAD_REQUESTS answered while a neighbouring stream is in flight,
    several beside one neighbour (one each took ~1.5 s of decoding per probe)."""
    return probes.probe_requests(server["base"], probes.BAD_REQUESTS, NEIGHBOUR_TOKENS)


def test_every_reproduction_has_an_expectation():
    assert set(EXPECTED) == set(probes.BAD_REQUESTS)


@pytest.mark.parametrize("name", list(probes.BAD_REQUESTS))
def test_bad_request_is_refused_by_name_and_neighbour_completes(bad_answers, name):
    result = bad_answers[name]
    status, param = EXPECTED[name]
    assert (result["status"], result["param"]) == (status, param), result
    assert result["neighbour_ok"], result  # the request beside it streamed in full


def test_unsupported_parameters_with_neutral_values_are_accepted(server):
    body = probes.completion(best_of=1, presence_penalty=0, frequency_penalty=0.0,
                             logit_bias={}, suffix=None)
    resp = probes.post(server["base"], "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_unknown_parameter_is_refused_by_name(server):
    resp = probes.post(server["base"], "/v1/completions", probes.completion(temprature=0.5))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "temprature" and "unknown parameter" in err["message"]


def test_oversize_prompt_is_refused_before_tokenizing_and_loop_stays_free(server):
    result = probes.probe_big_prompt(server["base"], size=3_000_000,  # under the body limit
                                     tokens=NEIGHBOUR_TOKENS)
    assert result["status"] == 400 and result["param"] == "prompt", result
    assert "characters" in result["message"], result  # refused by length, not tokenized
    assert result["seconds"] < 2.0 and result["max_health_s"] < 1.0, result
    assert result["neighbour_ok"], result


def test_long_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt short enough to be tokenized in full (about 0.1-0.5 s of tokenizer work) but
    longer than max_model_len: refused after tokenizing, while /health stays prompt."""
    result = probes.probe_big_prompt(server["base"], size=120_000, tokens=NEIGHBOUR_TOKENS)
    assert result["status"] == 400 and result["param"] == "prompt", result
    assert "tokens but max_model_len" in result["message"], result  # it was tokenized
    assert result["max_health_s"] < 1.0, result
    assert result["neighbour_ok"], result


def test_ten_megabyte_prompt_is_413(server):
    result = probes.probe_big_prompt(server["base"], size=10_000_000, tokens=NEIGHBOUR_TOKENS)
    assert result["status"] == 413 and result["seconds"] < 5.0, result
    assert result["neighbour_ok"], result


def test_server_serves_after_all_of_it(server):
    resp = probes.post(server["base"], "/v1/chat/completions",
                       {"messages": probes.CHAT_MESSAGES, "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] > 0
    assert httpx.get(server["base"] + "/health", trust_env=False).status_code == 200


# ---- shutdown -------------------------------------------------------------------------------
def test_second_sigint_exits_at_once_with_a_clear_message():
    result = probes.probe_second_sigint(ROOT)
    assert result["exit"] == 128 + signal.SIGINT, result
    assert any("second SIGINT" in line for line in result["tail"]), result


def test_drain_timeout_ends_open_streams_with_abort_and_done():
    started = time.monotonic()
    result = probes.probe_drain_timeout(ROOT)
    # probe: the stream was really cut (900 tokens cannot be generated within 2 s)
    assert result["finish_reason"] == "abort" and result["done"] is True, result
    assert result["exit"] == 0 and not result["cancelled_error_in_log"], result
    assert time.monotonic() - started < 180


# ---- probes.probe_requests itself (no server) -----------------------------------------------
def test_probe_requests_resends_a_late_answer_and_fails_all_beside_a_broken_neighbour(
        monkeypatch):
    import contextlib
    import threading

    # neighbours ending after 2 answers complete, after 2 broken, and one that outlives the rest
    lives = iter([(2, True), (2, False), (5, True)])
    seen: list[list[str]] = []

    @contextlib.contextmanager
    def neighbour(base, tokens=probes.NEIGHBOUR_TOKENS):
        answers, complete = next(lives)
        out = {"ended": threading.Event(), "left": answers, "errors": [], "tokens": tokens,
               "finish_reason": "length" if complete else None, "done": complete,
               "chunks": tokens if complete else 3}
        seen.append([])
        state["n"] = out
        yield out
        out["ok"] = probes._complete(out)

    def answer(base, path, body, raw):
        n = state["n"]
        seen[-1].append(body)
        n["left"] -= 1
        if n["left"] <= 0:
            n["ended"].set()
        return {"status": 400, "param": body}

    state: dict = {}
    monkeypatch.setattr(probes, "neighbour", neighbour)
    monkeypatch.setattr(probes, "_answer", answer)
    requests = {name: ("/p", name, None) for name in ("a", "b", "c", "d")}
    results = probes.probe_requests("http://x", requests)
    # "b" was answered as the first neighbour completed: sent again beside the second, which
    # broke: both requests beside it fail, neither is retried; "d" gets a third neighbour
    assert seen == [["a", "b"], ["b", "c"], ["d"]]
    assert [results[k]["neighbour_ok"] for k in "abcd"] == [True, False, False, True]
    assert [results[k]["param"] for k in "abcd"] == list("abcd")
