"""Tools and penalties through a real `tokenweir serve` on a tiny random-weight Llama whose chat
template takes tools (tests/model/tiny_models.py: TOOLS_TEMPLATE). The model's text is random,
so what is proved here is the wiring: the template received the tools (the chat prompt is
exactly the text the template renders with them), tool conversations render, streams work,
and penalties and logit_bias reach the sampler (the server's tokens equal the offline LLM's)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

import probes  # tests/server/probes.py

openai = probes.LazyModule("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import TOOLS_TEMPLATE, make_tiny_model, save_tiny_tokenizer  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[2])
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-tools")
    make_tiny_model("llama", str(path), seed=9)
    save_tiny_tokenizer(str(path), TOOLS_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_path):
    proc, base = probes.start_server(ROOT, "--max-model-len", "512", model=tiny_path)
    try:
        yield base
    finally:
        probes.stop_server(proc)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from tokenweir.model.tokenizer import Tokenizer
    return Tokenizer.from_hf_dir(tiny_path)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return probes.post(base, path, body)


def _prompt_tokens(base: str, body: dict, path: str = "/v1/chat/completions") -> int:
    resp = _post(base, path, {"max_tokens": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_the_chat_template_receives_the_tools(server, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER])
    assert "get_weather" in rendered
    with_tools = _prompt_tokens(server, {"messages": MESSAGES, "tools": [WEATHER]})
    # The same text sent as a plain prompt gives the same tokens: the server rendered exactly it.
    assert with_tools == _prompt_tokens(server, {"prompt": rendered}, "/v1/completions")
    without = _prompt_tokens(server, {"messages": MESSAGES})
    assert without < with_tools  # probe: the tools made the prompt longer
    # tool_choice "none" renders no tools
    assert _prompt_tokens(server, {"messages": MESSAGES, "tools": [WEATHER],
                                   "tool_choice": "none"}) == without


def test_a_tool_conversation_renders_its_calls_and_results(server, tokenizer):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = _post(server, "/v1/chat/completions",
                 {"messages": messages, "tools": [WEATHER], "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    local = [messages[0], {**messages[1], "content": "", "tool_calls": [{
        **messages[1]["tool_calls"][0],
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
    rendered = tokenizer.apply_chat_template(local, tools=[WEATHER])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert resp.json()["usage"]["prompt_tokens"] == _prompt_tokens(
        server, {"prompt": rendered}, "/v1/completions")


def test_openai_client_with_tools_whole_and_streamed(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=probes.API_KEY, max_retries=0,
                           timeout=60, http_client=httpx.Client(trust_env=False))
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=[WEATHER],
                  tool_choice="auto", max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length")  # random weights call no tool
    assert not choice.message.tool_calls
    stream = client.chat.completions.create(**kwargs, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_tool_choice_required_is_refused_by_name(server):
    resp = _post(server, "/v1/chat/completions",
                 {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


def test_logit_bias_and_penalties_reach_the_sampler(server, tiny_path, tokenizer):
    from tokenweir import LLM, SamplingParams
    prompt = [5, 17, 40, 41, 99, 5, 17, 300, 12]
    biased = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                               "temperature": 0, "logit_bias": {"57": 100}})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] == tokenizer.decode([57] * 5)
    fields = dict(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.7,
                  logit_bias={"60": 4.0, "61": -30})
    got = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                            "temperature": 0, "ignore_eos": True, **fields})
    plain = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                              "temperature": 0, "ignore_eos": True})
    llm = LLM(tiny_path, dtype="float32", device="cpu", max_model_len=512,
              num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            **{**fields, "logit_bias": {60: 4.0, 61: -30.0}})
    [offline] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got.json()["choices"][0]["text"] == offline.outputs[0].text
    assert plain.json()["choices"][0]["text"] != offline.outputs[0].text  # probe
