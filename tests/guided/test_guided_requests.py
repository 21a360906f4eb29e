"""The server's structured-output fields, in-process and without a model: response_format and
vLLM's guided_* become the engine's GuidedDecodingParams, and a bad one is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from tokenweir.request import GuidedDecodingParams
from tokenweir.server import protocol as P
from tokenweir.server.body import parse_json
from tokenweir.server.models import (UNSUPPORTED, ChatCompletionRequest, CompletionRequest,
                                     parse)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "Hi"}]


def guided_of(model, **fields) -> GuidedDecodingParams | None:
    body = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "Hi"}
    req = parse(model, parse_json(json.dumps({**body, **fields}).encode()))
    return P.sampling(req, chat=model is ChatCompletionRequest, vocab_size=1000).params \
        .guided_decoding


def refused(model, **fields) -> P.APIError:
    with pytest.raises(P.APIError) as exc:
        guided_of(model, **fields)
    assert exc.value.status == 400
    return exc.value


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("fields, expected", [
    (dict(response_format={"type": "json_object"}), GuidedDecodingParams(json_object=True)),
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     GuidedDecodingParams(json=SCHEMA)),
    (dict(guided_json=SCHEMA), GuidedDecodingParams(json=SCHEMA)),
    (dict(guided_json=json.dumps(SCHEMA)), GuidedDecodingParams(json=json.dumps(SCHEMA))),
    (dict(guided_regex="[0-9]+"), GuidedDecodingParams(regex="[0-9]+")),
    (dict(guided_choice=["a", "b"]), GuidedDecodingParams(choice=["a", "b"])),
    (dict(guided_grammar='root ::= "x"'), GuidedDecodingParams(grammar='root ::= "x"')),
    (dict(response_format={"type": "text"}), None),
    (dict(), None),
])
def test_fields_become_guided_decoding_params(model, fields, expected):
    assert guided_of(model, **fields) == expected


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(guided_json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     "guided_json"),
    (dict(guided_json="{not json"), "guided_json"),
    (dict(guided_regex="(("), "guided_regex"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_choice=["a", 1]), "guided_choice"),
    (dict(guided_grammar="start: ((("), "guided_grammar"),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    (dict(guided_regex="a+", ignore_eos=True), "ignore_eos"),
])
def test_a_bad_field_is_a_400_naming_it(fields, param):
    for model in (CompletionRequest, ChatCompletionRequest):
        assert refused(model, **fields).param == param


def test_guided_fields_are_no_longer_unsupported():
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        assert name not in UNSUPPORTED
