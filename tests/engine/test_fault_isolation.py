"""One bad request never hurts another (issue 14): a fault injected into one phase of handling
one request fails that request alone, with a clear error and its blocks freed, while its
neighbours finish with exactly the tokens of a fault-free run. Every test also probes that the
fault really fired. A tiny random-weight Llama through the real runner keeps this fast."""

from __future__ import annotations

import random

import pytest
import torch

from tokenweir import LLM, SamplingParams
from tokenweir.engine.llm_engine import LLMEngine
from tokenweir.faults import inject
from tokenweir.model.sampler import sample, sample_isolated

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              num_gpu_blocks_override=80, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
NUM_PROMPTS = 4


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 360) for _ in range(rng.randint(10, 40))]}
            for _ in range(NUM_PROMPTS)]


def _params() -> list[SamplingParams]:
    """Fresh objects per run (some tests corrupt one); one seeded random neighbour."""
    return [SamplingParams(**vars(SEEDED)) if i == 2 else SamplingParams(**vars(GREEDY))
            for i in range(NUM_PROMPTS)]


def _engine(path: str, **overrides) -> LLMEngine:
    return LLM(path, **{**ENGINE, **overrides}).llm_engine


def _run(engine: LLMEngine, params: list[SamplingParams], submit: bool = False,
         before_first_step=None) -> list:
    """Add (or submit, as the server does) every prompt, step until all are done, and return
    the final RequestOutputs in prompt order. A step must never raise."""
    made = [engine.make_request(p, sp) for p, sp in zip(_prompts(), params)]
    for request, text in made:
        (engine.submit_request if submit else engine.add_request)(request, text)
    if before_first_step is not None:
        before_first_step([r for r, _ in made])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[r.request_id] for r, _ in made]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_llama_path) -> list[list[int]]:
    outs = _run(_engine(tiny_llama_path), _params())
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return _tokens(outs)


def _assert_isolated(engine: LLMEngine, outs, victim: int, baseline, message: str) -> None:
    """The victim failed with `message`; every neighbour is exactly the fault-free output;
    the pool is back to idle and nothing leaked."""
    failed = outs[victim]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert message in (failed.error or ""), failed.error
    for i, out in enumerate(outs):
        if i != victim:
            assert out.outputs[0].finish_reason == "length" and out.error is None
            assert out.outputs[0].token_ids == baseline[i], f"neighbour {i} was hurt"
            assert out.outputs[0].text, "a neighbour lost its text"
    _assert_idle(engine)


def _assert_idle(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    assert not engine.has_unfinished_requests()
    scheduler.check_integrity()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks, "blocks leaked"
    assert scheduler.kv.usage() == 0
    assert not engine.outputs.states, "output state leaked"


@pytest.mark.parametrize("phase, skip, message", [
    ("sampling", 3, "sampling failed: InjectedFault"),
    ("detokenize", 2, "output failed: InjectedFault"),
    ("stop", 4, "output failed: InjectedFault"),
    ("output", 5, "output failed: InjectedFault"),
    ("admit", 0, "admission failed: injected"),
])
@pytest.mark.parametrize("victim", [0, 1, 3])
def test_fault_in_one_phase_fails_that_request_alone(tiny_llama_path, baseline, phase, skip,
                                                     message, victim):
    engine = _engine(tiny_llama_path)
    # Request ids are the engine's counter: the victim's is predictable.
    victim_id = str(victim)
    with inject(phase, {victim_id}, skip=skip) as record:
        outs = _run(engine, _params(), submit=(phase == "admit"))
    assert record.fired and set(record.fired) == {victim_id}, "the fault never fired"
    _assert_isolated(engine, outs, victim, baseline, message)
    if skip:  # it failed mid-generation, after some tokens: they were freed too
        assert 0 < len(outs[victim].outputs[0].token_ids) < len(baseline[victim])
    assert _tokens(_run(engine, _params())) == baseline, "the engine does not serve any more"


def test_corrupt_params_fail_in_the_sampler_alone(tiny_llama_path, baseline):
    """A real sampler failure: params corrupted after validation (the bug of issue 14, #1:
    stop_token_ids ['a'] with min_tokens), so the batched draw raises."""
    engine = _engine(tiny_llama_path)
    params = _params()

    def corrupt(requests) -> None:
        params[1].min_tokens, params[1].stop_token_ids = 2, ["a"]

    outs = _run(engine, params, before_first_step=corrupt)
    _assert_isolated(engine, outs, 1, baseline, "sampling failed: TypeError")


@pytest.mark.parametrize("victim", [0, 1, 3])
def test_corrupt_params_fail_in_the_stop_rules_alone(tiny_llama_path, baseline, victim):
    """A real failure inside the scheduler's update (the token stop rules): stop_token_ids
    corrupted into an int after admission. The per-request guard in update_from_output fails
    the culprit alone, wherever it sits in the step's order."""
    engine = _engine(tiny_llama_path)
    params = _params()
    params[victim] = SamplingParams(**{**vars(params[victim]), "stop_token_ids": [383]})

    def corrupt(requests) -> None:
        params[victim].stop_token_ids = 5  # `token in 5` raises TypeError

    outs = _run(engine, params, before_first_step=corrupt)
    _assert_isolated(engine, outs, victim, baseline, "not iterable")
    assert "stop rules" in outs[victim].error


def test_forward_failure_fails_that_step_and_the_engine_serves_on(tiny_llama_path, baseline):
    """One request at a time (max_num_seqs=1): the forward fails in the victim's third step,
    so only the victim is in the failed step; the others then run to the exact output."""
    engine = _engine(tiny_llama_path, max_num_seqs=1)
    with inject("forward", {"1"}, skip=2) as record:
        outs = _run(engine, _params())
    assert record.fired == ["1"]
    _assert_isolated(engine, outs, 1, baseline, "the model forward failed")


def test_forward_failure_fails_every_request_of_the_step(tiny_llama_path, baseline):
    engine = _engine(tiny_llama_path)
    with inject("forward", {"0"}, skip=3) as record:
        outs = _run(engine, _params())
    assert record.fired == ["0"]
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("error") >= 2, "everyone in the step should have failed"
    for out, expected in zip(outs, baseline):
        if out.outputs[0].finish_reason == "error":
            assert "the model forward failed" in out.error
        else:
            assert out.outputs[0].token_ids == expected
    _assert_idle(engine)
    assert _tokens(_run(engine, _params())) == baseline, "the engine does not serve any more"


def test_sample_isolated_matches_the_batch_for_good_rows():
    """The per-row fallback gives every good row the draw it had in the batch, unseeded
    random rows included (their draw depends on their row index)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 97)
    good = [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
            SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(temperature=0.7)]
    batch = sample(logits, good, [0, 1, 2, 3], frozenset({2}), 11, 5).token_ids
    bad = [*good]
    bad[1] = SamplingParams(temperature=0.8)
    bad[1].top_p = "x"  # corrupted after validation
    out, errors = sample_isolated(logits, bad, [0, 1, 2, 3], frozenset({2}), 11, 5,
                                  ["a", "b", "c", "d"])
    assert list(errors) == [1] and "sampling failed" in errors[1]
    assert out.token_ids[1] == -1
    assert [t for i, t in enumerate(out.token_ids) if i != 1] == \
        [t for i, t in enumerate(batch) if i != 1]


def test_streaming_deltas_end_in_one_error_for_the_victim_only(tiny_llama_path, baseline):
    """The server's path (submit, step(delta=True)): the victim's stream ends with one final
    delta, finish_reason 'error' and the message; every other stream adds up to its
    fault-free tokens."""
    engine = _engine(tiny_llama_path)
    made = [engine.make_request(p, sp) for p, sp in zip(_prompts(), _params())]
    for request, text in made:
        engine.submit_request(request, text)
    streams: dict[str, list] = {r.request_id: [] for r, _ in made}
    with inject("detokenize", {"2"}, skip=3) as record:
        while engine.has_unfinished_requests():
            for out in engine.step(delta=True):
                streams[out.request_id].append(out)
    assert record.fired == ["2"]
    for i, (request, _) in enumerate(made):
        deltas = streams[request.request_id]
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
        if i == 2:
            assert deltas[-1].outputs[0].finish_reason == "error"
            assert "injected detokenize fault" in deltas[-1].error
        else:
            assert deltas[-1].outputs[0].finish_reason == "length"
            assert [t for d in deltas for t in d.outputs[0].token_ids] == baseline[i]
    _assert_idle(engine)


def test_update_guard_fails_one_request_and_updates_the_rest():
    """The guard inside Scheduler.update_from_output, without the engine: in every step the
    culprit (corrupted stop_token_ids) sits between neighbours; it fails in its first update
    with blocks freed, and every neighbour finishes with exactly its fault-free tokens."""
    from tests.core.harness import FakeRunner, expected_output, make_request, make_scheduler
    from tokenweir.request import RequestStatus

    scheduler, runner = make_scheduler(num_blocks=64, block_size=4, max_model_len=64), FakeRunner()
    requests = [make_request(f"r{i}", 5 + i, 6, stop_token_ids=[999]) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    requests[2].sampling_params.stop_token_ids = 5  # `token in 5` raises TypeError
    outputs, steps = {}, 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if steps == 0:
            assert list(out.num_scheduled_tokens) == [r.request_id for r in requests]
        for eco in scheduler.update_from_output(out, runner.execute(out)):
            if eco.finish_reason is not None:
                assert eco.request.request_id not in outputs
                outputs[eco.request.request_id] = (eco.finish_reason, eco.new_token_ids)
        scheduler.check_integrity()
        steps += 1
    culprit = requests[2]
    assert outputs["r2"] == ("error", []) and culprit.status == RequestStatus.FINISHED_ERROR
    assert "stop rules" in culprit.error and "not iterable" in culprit.error
    assert culprit.num_output_tokens <= 1  # it failed in its first update (its first token)
    for request in requests[:2] + requests[3:]:
        assert outputs[request.request_id][0] == "length"
        assert request.output_token_ids == expected_output(request, None)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks, "blocks leaked"


class _FirstRequestSeen:
    """A request-id set for `inject` that holds the first id asked about: a server's request
    ids are random, so the fault picks the first request that reaches the point."""

    def __init__(self) -> None:
        self.request_id = None

    def __contains__(self, request_id: str) -> bool:
        self.request_id = self.request_id or request_id
        return request_id == self.request_id


@pytest.fixture()
def client(tiny_llama_path):
    from fastapi.testclient import TestClient

    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.server.app import create_app
    from tokenweir.server.settings import ServerSettings

    engine = AsyncEngine(_engine(tiny_llama_path))
    app = create_app(engine, ServerSettings(served_model_names=("tiny",), timeline_steps=0))
    with TestClient(app) as test_client:
        yield test_client


def _sse_events(text: str) -> list:
    import json
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def test_the_error_message_reaches_the_streaming_client(client):
    """A stream whose request fails mid-way ends with its final chunk (finish_reason "error"),
    then one error event with the engine's message, then [DONE]."""
    with inject("sampling", _FirstRequestSeen(), skip=3) as record:
        resp = client.post("/v1/completions", json={**BODY, "stream": True})
    assert record.fired, "the fault never fired"
    assert resp.status_code == 200
    events = _sse_events(resp.text)
    assert events[-1] == "[DONE]"
    error, final = events[-2], events[-3]
    assert final["choices"][0]["finish_reason"] == "error"
    assert "sampling failed: InjectedFault" in error["error"]["message"]
    assert error["error"]["type"] == "internal_error"
    assert sum(1 for e in events if isinstance(e, dict) and "error" in e) == 1
    ok = client.post("/v1/completions", json={**BODY, "stream": True})  # the server serves on
    assert _sse_events(ok.text)[-2]["choices"][0]["finish_reason"] == "length"


def test_the_error_message_reaches_the_client_as_a_500(client):
    with inject("sampling", _FirstRequestSeen(), skip=1) as record:
        resp = client.post("/v1/completions", json=BODY)
    assert record.fired
    assert resp.status_code == 500
    assert "sampling failed: InjectedFault" in resp.json()["error"]["message"]
    assert client.post("/v1/completions", json=BODY).status_code == 200


def test_an_invalid_request_refused_by_the_engine_is_a_400(tiny_llama_path):
    """A ValueError at admission (here prompt + max_tokens over max_model_len, set past the
    edge's check) is the client's error: its message starts with INVALID_REQUEST, which the
    server answers 400; an injected (internal) admission failure maps to 500."""
    from tokenweir.engine.engine_core import INVALID_REQUEST, error_http_status

    engine = _engine(tiny_llama_path)
    first, text = engine.make_request(_prompts()[0], SamplingParams(**vars(GREEDY)))
    too_long, too_long_text = engine.make_request(_prompts()[1],
                                                  SamplingParams(**vars(GREEDY)))
    too_long.max_tokens = 10_000
    engine.submit_request(first, text)
    engine.submit_request(too_long, too_long_text)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    errors = [o.error for o in outputs if o.outputs[0].finish_reason == "error"]
    assert len(errors) == 1 and errors[0].startswith(INVALID_REQUEST), errors
    assert "exceeds max_model_len" in errors[0]
    assert [o.outputs[0].finish_reason for o in outputs].count("length") == 1  # the neighbour
    assert error_http_status(errors[0]) == 400
    assert error_http_status("admission failed: InjectedFault('x')") == 500
    assert error_http_status("sampling failed: TypeError()") == 500
