"""Tool calling without a model (issue 15): the Hermes-style parser on fixed text, the stream
filter that holds back `<tool_call>` text, the chat response shapes built from it, the
request models, and the tokenizer's check that a chat template takes tools."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenweir.model.tokenizer import Tokenizer
from tokenweir.request import SamplingParams
from tokenweir.server import protocol as P
from tokenweir.server.models import ChatCompletionRequest, CompletionRequest, parse
from tokenweir.server.shapes import ChatShape, collect, stream_chunks
from tokenweir.server.tool_calls import (ToolCallStream, parse_tool_calls, tools_for_template)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import TOOLS_TEMPLATE  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


# ---- parser ---------------------------------------------------------------------------------
def _functions(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.tool_calls]


def test_one_call_and_no_content():
    parsed = parse_tool_calls("\n" + CALL + "\n")
    assert parsed.content is None
    assert _functions(parsed) == [("get_weather", {"city": "Paris"})]
    call = parsed.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert isinstance(call["function"]["arguments"], str)  # OpenAI: a JSON string


def test_content_before_and_several_calls():
    text = ("Let me check. " + CALL + '\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"tz": "CET", "exact": true}}\n</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check. "
    assert _functions(parsed) == [("get_weather", {"city": "Paris"}),
                                  ("get_time", {"tz": "CET", "exact": True})]
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    assert _functions(parse_tool_calls(text, parallel=False)) == [
        ("get_weather", {"city": "Paris"})]


def test_an_unclosed_last_call_is_parsed_when_its_json_is_whole():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert _functions(parsed) == [("f", {})]


@pytest.mark.parametrize("text", [
    "plain answer, no call",
    '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # cut short
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["f"]</tool_call>',
    CALL + '<tool_call>not json</tool_call>',  # one bad call: nothing is parsed
])
def test_anything_but_whole_calls_is_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_string_arguments_are_kept_as_given():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"x": 2}'


# ---- stream filter ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, content, names", [
    ("Sure. " + CALL, "Sure. ", ["get_weather"]),
    ("a < b and <tool_ is not a call", "a < b and <tool_ is not a call", []),
    ("ends with <tool_c", "ends with <tool_c", []),
    ("<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_holds_back_tool_call_text(text, content, names, step):
    stream = ToolCallStream()
    sent = []
    for i in range(0, len(text), step):
        sent.append(stream.feed(text[i:i + step]))
        assert "<tool_call>" not in "".join(sent)
    rest, calls = stream.finish()
    assert "".join(sent) + rest == content
    assert [c["function"]["name"] for c in calls] == names


# ---- response shapes ------------------------------------------------------------------------
def _outputs(pieces: list[str], finish_reason: str = "stop"):
    """Fake engine deltas: one per piece, the last one finished."""
    async def gen():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield SimpleNamespace(
                prompt_token_ids=[1, 2, 3], finished=last, error=None,
                outputs=[SimpleNamespace(index=0, text=piece, token_ids=[7], logprobs=None,
                                         finish_reason=finish_reason if last else None,
                                         stop_reason=None)])
    return gen()


def _shape(tool_calls: bool = True, parallel: bool = True) -> ChatShape:
    parsed = P.Parsed(params=SamplingParams(), priority=0, ttft_slo_ms=None, stream=False,
                      include_usage=False, top_logprobs=None)
    return ChatShape("chatcmpl-1", "m", parsed, None, tool_calls=tool_calls,
                     parallel_tool_calls=parallel)


def test_whole_answer_carries_tool_calls_and_finish_reason():
    pieces = ["I'll look. <tool", "_call>{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Paris\"}}</tool_call>"]
    body = asyncio.run(collect(_shape(), _outputs(pieces)))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I'll look. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain = asyncio.run(collect(_shape(tool_calls=False), _outputs(pieces)))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces)}
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_stream_sends_content_then_the_calls_in_the_final_chunk():
    pieces = ["Checking", " now. <tool_", "call>{\"name\": \"get_weather\", \"arguments\": ",
              "{\"city\": \"Paris\"}}</tool_call>"]

    async def run():
        return [c async for c in stream_chunks(_shape(), _outputs(pieces))]
    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Checking now. "
    assert all("tool_calls" not in d for d in deltas[:-1])
    [call] = deltas[-1]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_no_call_streams_every_character_and_keeps_the_finish_reason():
    pieces = ["a <tool", " b", " c"]

    async def run():
        return [c async for c in stream_chunks(_shape(), _outputs(pieces, "length"))]
    chunks = asyncio.run(run())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "a <tool b c"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- request models and tool_choice ---------------------------------------------------------
def _chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": MESSAGES, **fields})


def test_tools_for_template_by_tool_choice():
    assert tools_for_template(_chat(), True) is None
    assert tools_for_template(_chat(tools=[WEATHER]), True) == [WEATHER]
    assert tools_for_template(_chat(tools=[WEATHER], tool_choice="auto"), True) == [WEATHER]
    # "none" renders no tools, so it works whatever the template
    assert tools_for_template(_chat(tools=[WEATHER], tool_choice="none"), False) is None
    assert tools_for_template(_chat(tool_choice="none"), False) is None


@pytest.mark.parametrize("fields, takes, param, fragment", [
    (dict(tools=[WEATHER]), False, "tools", "does not take tools"),
    (dict(tools=[WEATHER], tool_choice="auto"), False, "tools", "does not take tools"),
    (dict(tool_choice="auto"), True, "tool_choice", "needs 'tools'"),
    (dict(tools=[WEATHER], tool_choice="required"), True, "tool_choice", "not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function",
                                        "function": {"name": "get_weather"}}),
     True, "tool_choice", "not supported"),
])
def test_tool_requests_refused(fields, takes, param, fragment):
    with pytest.raises(P.APIError) as exc:
        tools_for_template(_chat(**fields), takes)
    assert exc.value.param == param and fragment in exc.value.message


@pytest.mark.parametrize("fields, param", [
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "junk": 1}}]), "tools"),
    (dict(tool_choice="always"), "tool_choice"),
    (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]), "messages"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                          "function": {"name": "f"}}]}]),
     "messages"),
])
def test_bad_tool_fields_are_refused_by_name(fields, param):
    with pytest.raises(P.APIError) as exc:
        parse(ChatCompletionRequest, {"messages": MESSAGES, **fields})
    assert exc.value.param == param


def test_completions_still_refuse_tools_but_take_their_neutral_values():
    with pytest.raises(P.APIError) as exc:
        parse(CompletionRequest, {"prompt": "x", "tools": [WEATHER]})
    assert exc.value.param == "tools" and "not supported" in exc.value.message
    assert parse(CompletionRequest, {"prompt": "x", "tools": [], "tool_choice": "none"})


def test_a_tool_conversation_reaches_the_template_with_object_arguments():
    req = _chat(messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    messages = P.messages_of(req)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    text = _tokenizer(TOOLS_TEMPLATE).apply_chat_template(messages, tools=[WEATHER])
    assert '"name": "get_weather"' in text.split("<s>user")[0]  # the tools' system turn
    assert CALL in text and "<s>tool\nsunny, 21 C</s>" in text


# ---- tokenizer -----------------------------------------------------------------------------
def _tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Rust
    from tokenizers.models import WordLevel
    return Tokenizer(Rust(WordLevel({"a": 0}, unk_token="a")), chat_template=template)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tokenizer_knows_whether_its_template_takes_tools():
    tools_tok, plain_tok = _tokenizer(TOOLS_TEMPLATE), _tokenizer(CHATML)
    assert tools_tok.chat_template_takes_tools and not plain_tok.chat_template_takes_tools
    assert "get_weather" in tools_tok.apply_chat_template(MESSAGES, tools=[WEATHER])
    assert "get_weather" not in tools_tok.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="does not take tools"):
        plain_tok.apply_chat_template(MESSAGES, tools=[WEATHER])
