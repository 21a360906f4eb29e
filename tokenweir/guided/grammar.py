"""From GuidedDecodingParams to an llguidance grammar, checked.

`compile_grammar(params)` returns the grammar text an `llguidance.LLMatcher` takes, or raises
ValueError whose message starts with the field at fault (`guided_decoding.json: ...`), for a
schema, regex or grammar llguidance refuses. Nothing here depends on the tokenizer, so the
server checks a request before it queues it and the engine checks it again when it is made.

JSON is generated compactly, the way `json.dumps` writes it (", " and ": ", no other
whitespace): a small model sampled at temperature 1 cannot then wander off into endless
whitespace between tokens, which flexible whitespace would allow.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance

from tokenweir.request import GuidedDecodingParams, SamplingParams

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


def check_guided(params: SamplingParams, tokenizer: Any) -> None:
    """ValueError naming the field when the request's schema, regex, choice or grammar does
    not compile, or when the model has no tokenizer to guide with."""
    if params.guided_decoding is None:
        return
    if tokenizer is None:
        raise ValueError("guided_decoding needs the model's tokenizer, and this model has none")
    compile_grammar(params.guided_decoding)


def compile_grammar(params: GuidedDecodingParams) -> str:
    """The llguidance grammar for `params`; ValueError naming the field when it is invalid."""
    kind = params.kind
    where = f"guided_decoding.{kind}"
    try:
        spec_text = _spec_text(kind, params.spec)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return _checked(kind, spec_text)


def _spec_text(kind: str, spec: Any) -> str:
    """The spec as text (the key of the compile cache): schemas and choices as JSON."""
    if kind == "json":
        if isinstance(spec, str):
            spec = json.loads(spec)
        if not isinstance(spec, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(spec).__name__}")
        return json.dumps(spec)  # key order kept: properties are generated in this order
    if kind == "json_object":
        return json.dumps(ANY_JSON_OBJECT)
    if kind == "choice":
        return json.dumps(list(spec))
    return spec


@lru_cache(maxsize=256)
def _checked(kind: str, spec_text: str) -> str:
    where = f"guided_decoding.{kind}"
    try:
        grammar = _to_grammar(kind, spec_text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{where} is invalid: {messages[0] if messages else 'rejected'}")
    return grammar


def _to_grammar(kind: str, spec_text: str) -> str:
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec_text, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec_text)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec_text)
    return llguidance.grammar_from("grammar", spec_text)  # Lark, or GBNF converted to Lark
