"""The edge validation on its own, in-process and without a model: request models, JSON body
parsing and the body-size limit. (test_robustness.py runs the same inputs against a server.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenweir.request import SamplingParams
from tokenweir.server import protocol as P
from tokenweir.server.body import BodyLimit, parse_json
from tokenweir.server.models import (UNSUPPORTED, ChatCompletionRequest, CompletionRequest,
                                     parse)

VOCAB = 1000


def refused(model, raw: bytes) -> P.APIError:
    with pytest.raises(P.APIError) as exc:
        parse(model, parse_json(raw))
    assert exc.value.status == 400
    json.dumps(exc.value.body(), ensure_ascii=True)  # always serialisable
    return exc.value


def completion(**fields) -> bytes:
    return json.dumps({"prompt": "Hi", "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "abc \\ud800"}', "prompt"),
    (b'{"prompt": "ok", "stop": ["\\udfff"]}', "stop"),
    (b'{"prompt": "ok", "\\ud800": 1}', "\\ud800"),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"prompt": ' + b"[" * 5_000 + b"1" + b"]" * 5_000 + b"}", None),
    (b'{"prompt": ' + b"[" * 900 + b"1" + b"]" * 900 + b"}", "prompt"),
    (b'{"prompt": "Hi", "top_k": 1' + b"0" * 400 + b"}", "top_k"),
    (completion(stop_token_ids=["a"], min_tokens=2), "stop_token_ids"),
    (completion(temperature="hot"), "temperature"),
    (completion(temperature=True), "temperature"),
    (b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "Hi", "top_p": Infinity}', "top_p"),
    (completion(max_tokens="4"), "max_tokens"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(seed=2 ** 64), "seed"),
    (completion(logprobs=21), "logprobs"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[-1]), "prompt"),
    (completion(prompt=["a", "b"]), "prompt"),
    (completion(stream_options={"include_usage": True, "x": 1}), "stream_options"),
    (completion(junk=1), "junk"),
    (b'{"max_tokens": 4}', "prompt"),
    (b"[1, 2]", None),
])
def test_completion_refusals_name_the_field(raw, param):
    assert refused(CompletionRequest, raw).param == param


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": 5}],
    [{"role": 1, "content": "hi"}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
    [],
    "hi",
])
def test_chat_message_refusals_name_messages(messages):
    raw = json.dumps({"messages": messages}).encode()
    assert refused(ChatCompletionRequest, raw).param == "messages"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_unsupported_parameter_is_refused_by_name(name):
    err = refused(CompletionRequest, completion(**{name: "x"}))
    assert err.param == name and "not supported" in err.message


def test_neutral_values_of_unsupported_parameters_pass():
    req = parse(CompletionRequest, parse_json(completion(
        best_of=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, suffix=None,
        tools=[], tool_choice="none")))
    assert req.prompt == "Hi"


def test_neutral_check_is_by_type_not_truthiness():
    assert refused(CompletionRequest, completion(best_of=True)).param == "best_of"


def test_sampling_turns_a_valid_model_into_params():
    req = parse(CompletionRequest, parse_json(completion(
        temperature=0, top_k=-1, stop="\n", stop_token_ids=[5], seed=7, logprobs=2,
        priority=3, ttft_slo_ms=250, stream=True, stream_options={"include_usage": True})))
    parsed = P.sampling(req, chat=False, vocab_size=VOCAB)
    assert isinstance(parsed.params, SamplingParams)
    assert (parsed.params.temperature, parsed.params.top_k, parsed.params.stop) == \
        (0, 0, ["\n"])
    assert (parsed.priority, parsed.ttft_slo_ms, parsed.stream, parsed.include_usage,
            parsed.top_logprobs) == (3, 250.0, True, True, 2)
    assert parsed.tpot_slo_ms is None  # not given: the engine's --slo-tpot-ms applies


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_tpot_slo_ms_is_accepted_as_ttft_slo_ms_is(model):
    fields = {"ttft_slo_ms": 250, "tpot_slo_ms": 40}
    raw = completion(**fields) if model is CompletionRequest else json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], **fields}).encode()
    parsed = P.sampling(parse(model, parse_json(raw)), chat=model is ChatCompletionRequest,
                        vocab_size=VOCAB)
    assert (parsed.ttft_slo_ms, parsed.tpot_slo_ms) == (250.0, 40.0)


@pytest.mark.parametrize("value", [0, -5, "fast", True])
def test_tpot_slo_ms_must_be_a_positive_number(value):
    assert refused(CompletionRequest, completion(tpot_slo_ms=value)).param == "tpot_slo_ms"


@pytest.mark.parametrize("fields, param", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
])
def test_sampling_refusals_name_the_field(fields, param):
    req = parse(CompletionRequest, parse_json(completion(**fields)))
    with pytest.raises(P.APIError) as exc:
        P.sampling(req, chat=False, vocab_size=VOCAB)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_chat_sampling_defaults_and_logprobs():
    raw = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 5, "max_tokens": 9, "logprobs": True,
        "top_logprobs": 3}).encode()
    req = parse(ChatCompletionRequest, parse_json(raw))
    parsed = P.sampling(req, chat=True, vocab_size=VOCAB)
    assert parsed.params.max_tokens == 5 and parsed.top_logprobs == 3
    assert P.messages_of(req) == [{"role": "user", "content": "ab"}]
    no_logprobs = parse(ChatCompletionRequest, parse_json(json.dumps(
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}).encode()))
    with pytest.raises(P.APIError) as exc:
        P.sampling(no_logprobs, chat=True, vocab_size=VOCAB)
    assert exc.value.param == "top_logprobs"


# ---- body limit -----------------------------------------------------------------------------
async def _run(app, body: bytes, declared: bool, chunk: int = 1000) -> tuple[int, bytes, int]:
    """Drive an ASGI app with `body` in chunks; (status, response body, bytes it read)."""
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    sent: list[dict] = []
    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}

    async def receive() -> dict:
        piece = chunks.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, payload, len(body) - sum(len(c) for c in chunks)


async def _echo_length(scope, receive, send) -> None:
    """A stand-in application: reads the whole body, answers 200 with its length."""
    from tokenweir.server.app import error_response
    total, more = 0, True
    try:
        while more:
            message = await receive()
            total += len(message.get("body", b""))
            more = message.get("more_body", False)
    except P.APIError as err:  # what the routes' exception handler does
        await error_response(err)(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(total).encode()})


@pytest.mark.parametrize("declared", [True, False])
def test_body_limit_413_before_reading_it_all(declared):
    app = BodyLimit(_echo_length, max_bytes=10_000)
    status, payload, read = asyncio.run(_run(app, b"x" * 50_000, declared))
    assert status == 413 and json.loads(payload)["error"]["code"] == "request_too_large"
    assert read <= 11_000  # refused early, not after the whole body
    ok_status, ok_payload, _ = asyncio.run(_run(app, b"x" * 10_000, declared))
    assert ok_status == 200 and ok_payload == b"10000"  # probe: at the limit it passes


def test_submit_hands_tpot_slo_ms_to_the_engine():
    """The body's tpot_slo_ms reaches AsyncEngine.add (which gives it to make_request)."""
    from prometheus_client import CollectorRegistry

    from tokenweir.server.settings import ServerSettings
    from tokenweir.server.state import AppState

    class RecordingEngine:
        is_running, num_unstarted = True, 0

        async def add(self, *args, **kwargs):
            self.kwargs = kwargs
            return "the queue"

    engine = RecordingEngine()
    state = AppState(engine, ServerSettings(served_model_names=("m",)), CollectorRegistry())
    parsed = P.sampling(parse(CompletionRequest, parse_json(completion(tpot_slo_ms=40))),
                        chat=False, vocab_size=VOCAB)
    assert asyncio.run(state.submit("Hi", parsed, "r1")) == "the queue"
    assert engine.kwargs["tpot_slo_ms"] == 40.0
