"""Structured output through a real `tokenweir serve` (the default model), with the official
openai client: chat with response_format json_schema, completions with guided_choice and a
streamed guided_regex, and a bad schema refused with a 400 naming response_format."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import pytest

openai = pytest.importorskip("openai")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))
import probes  # noqa: E402  (tests/server/probes.py: starts a server subprocess)

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    proc, base = probes.start_server(ROOT)
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key=probes.API_KEY, max_retries=0,
                            timeout=300, http_client=httpx.Client(trust_env=False))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            proc.kill()


def test_chat_response_format_json_schema(client):
    """Two seeds, sent at once: the server batches them (their steps overlap instead of
    adding up)."""
    validator = jsonschema_rs.validator_for(SCHEMA)

    def ask(seed: int):
        return client.chat.completions.create(
            model=probes.MODEL, messages=[{"role": "user", "content": "A city, as JSON."}],
            temperature=1.0, seed=seed, max_tokens=80,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA}})

    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(ask, range(2)))
    for resp in responses:
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        assert validator.is_valid(json.loads(choice.message.content))


def test_completions_guided_choice_and_streamed_regex(client):
    choices = ["red", "green", "blue"]
    resp = client.completions.create(model=probes.MODEL, prompt="My favourite colour is",
                                      max_tokens=8, seed=1, extra_body={"guided_choice": choices})
    assert resp.choices[0].text in choices and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=probes.MODEL, prompt="The date is", max_tokens=20,
                                       seed=2, stream=True,
                                       extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=probes.MODEL, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert exc.value.body["param"] == "response_format"


def test_a_regex_the_model_cannot_spell_is_a_400_and_the_server_serves_on(client):
    """The fuzzer's body (tests/server/test_fuzz.py found it): the regex needs the byte 0xF1,
    which no SmolLM2 token spells; it answered 500 ("the grammar refused token 237")."""
    regex = ("ë\U0005378eó}\x92\x80\x0f&\U000e1431æ5\x8f\x8b\x11\U000c8496\x14-\U000a8b30"
             "\x9eÔ\x8d𧠒j")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=probes.MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"guided_regex": regex})
    assert "no token of this model can continue the grammar" in exc.value.body["message"]
    resp = client.completions.create(model=probes.MODEL, prompt="Hi", max_tokens=2)
    assert resp.choices[0].finish_reason == "length"
