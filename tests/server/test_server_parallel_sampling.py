"""The server's `n` and `best_of` (completions and chat), whole and streamed, on an in-process
app over a tiny random-weight Llama (tests/model/tiny_models.py): a choice per sample with its
`index`, streamed chunks tagged by index, usage summed over the choices, best_of refused when
streamed (as vLLM does)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from tokenweir.config import EngineConfig
from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.llm_engine import LLMEngine
from tokenweir.server.app import create_app
from tokenweir.server.settings import ServerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    path = tmp_path_factory.mktemp("tiny-llama-server-n")
    make_tiny_model("llama", str(path), seed=4)
    save_tiny_tokenizer(str(path), TEMPLATE)
    config = EngineConfig.from_kwargs(model=str(path), dtype="float32", device="cpu",
                                      max_model_len=128, block_size=8,
                                      num_gpu_blocks_override=200)
    return LLMEngine(config)


def serve(engine: LLMEngine, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """POST each (path, body) in turn to a fresh app over `engine`; the responses."""
    async def run() -> list[httpx.Response]:
        async_engine = AsyncEngine(engine)
        async_engine.start(asyncio.get_running_loop())
        app = create_app(async_engine, ServerSettings(served_model_names=(MODEL,)))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=120) as http:
                return [await http.post(path, json=body) for path, body in requests]
        finally:
            async_engine.shutdown()
    return asyncio.run(run())


def events(resp: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 10, "ignore_eos": True}


def test_completions_n_whole_and_streamed(tiny_engine):
    body = {"model": MODEL, "prompt": "once upon a time", "n": 3, **SAMPLED}
    whole, streamed = serve(tiny_engine, [
        ("/v1/completions", body),
        ("/v1/completions", {**body, "stream": True,
                             "stream_options": {"include_usage": True}})])
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
    assert len({c["text"] for c in answer["choices"]}) > 1, "the samples should differ"
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3 * 10 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 30  # the prompt counted once

    chunks = events(streamed)
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]  # one choice per chunk, tagged by its index
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c["text"] for c in answer["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def test_chat_n_whole_and_streamed(tiny_engine):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "n": 2,
            **SAMPLED}
    whole, streamed = serve(tiny_engine, [
        ("/v1/chat/completions", body),
        ("/v1/chat/completions", {**body, "stream": True})])
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert whole.json()["usage"]["completion_tokens"] == 20
    chunks = events(streamed)
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]  # an opening chunk per choice
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in choices]


def test_best_of_whole_keeps_n_and_is_refused_streamed(tiny_engine):
    body = {"model": MODEL, "prompt": "the river", "n": 2, "best_of": 4, **SAMPLED}
    whole, streamed, bad_n = serve(tiny_engine, [
        ("/v1/completions", body),
        ("/v1/completions", {**body, "stream": True}),
        ("/v1/completions", {**body, "best_of": 1})])
    assert whole.status_code == 200, whole.text
    assert [c["index"] for c in whole.json()["choices"]] == [0, 1]
    assert whole.json()["usage"]["completion_tokens"] == 20
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "best_of"
    assert bad_n.status_code == 400 and bad_n.json()["error"]["param"] == "best_of"
