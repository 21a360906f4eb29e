"""Request models of the OpenAI-compatible API (pydantic), shared by completions and chat.

Contract: `parse(model_class, body)` either returns a validated model or raises `APIError`
(400) whose `param` names the offending top-level field. Types are strict (no "1" for 1, no
true for 1), numbers are finite and integers fit in 64 bits, so nothing that passes can make
the engine's step raise. A parameter tokenweir does not honour is refused by name
(`UNSUPPORTED`), unless it carries its neutral value; an unknown one is refused too.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr, ValidationError,
                      model_validator)

from tokenweir.request import GuidedDecodingParams
from tokenweir.server.errors import APIError

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_LOGPROBS = 20

Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]
Penalty = Annotated[float, Strict(), Field(allow_inf_nan=False, ge=-2, le=2)]
# logit_bias keys: token ids written as decimal strings (JSON object keys are strings).
TokenIdKey = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,18}$")]

# name -> its neutral values: sending one of these (or null) changes nothing, so it is allowed.
# A request model that declares one of these names as a field supports it (chat: tools).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (),
    "functions": ([],), "function_call": ("none",), "use_beam_search": (False,),
    "prompt_logprobs": (), "length_penalty": (1,), "truncate_prompt_tokens": (),
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: Optional[StrictBool] = None


class JsonSchemaFormat(StrictModel):
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: Optional[StrictBool] = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class GuidedFields(StrictModel):
    """Structured output: OpenAI's response_format and vLLM's guided_* (at most one)."""

    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[StrictStr, dict[str, Any]]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[Annotated[list[StrictStr], Field(min_length=1)]] = None
    guided_grammar: Optional[StrictStr] = None


class SamplingFields(GuidedFields):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""

    model: Optional[StrictStr] = None
    n: Optional[Int64] = Field(None, description="samples to return (1..256)")
    best_of: Optional[Int64] = Field(
        None, description="samples to draw (>= n), of which the n with the highest cumulative "
                          "logprob are returned; not with stream")
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Annotated[Float, Field(ge=0)]] = None
    top_p: Optional[Annotated[Float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Strict(), Field(ge=-1, le=INT64_MAX)]] = None
    min_p: Optional[Annotated[Float, Field(ge=0, le=1)]] = None
    seed: Optional[Int64] = None
    max_tokens: Optional[PositiveInt] = None
    min_tokens: Optional[NonNegativeInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[NonNegativeInt]] = None
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    include_stop_str_in_output: Optional[StrictBool] = None
    priority: Optional[Int64] = None
    ttft_slo_ms: Optional[Annotated[Float, Field(gt=0)]] = None
    tpot_slo_ms: Optional[Annotated[Float, Field(gt=0)]] = None
    user: Optional[StrictStr] = None
    # ---- penalties and bias (issue 15): OpenAI's and vLLM's ranges ----
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[Float, Field(gt=0)]] = None
    logit_bias: Optional[dict[TokenIdKey, Annotated[Float, Field(ge=-100, le=100)]]] = None


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1,
                                                                      max_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]]
    echo: Optional[StrictBool] = None
    logprobs: Optional[TopLogprobs] = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: StrictStr


# ---- tools (issue 15): OpenAI's shapes ----
FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionRef


class FunctionCall(StrictModel):
    name: StrictStr
    arguments: StrictStr


class ToolCall(StrictModel):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictModel):
    """A message; `tool_calls` only on an assistant's, `tool_call_id` only on a tool's."""

    role: StrictStr
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _tool_fields_match_the_role(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message carries tool_call_id")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[TopLogprobs] = None
    add_generation_prompt: Optional[StrictBool] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def parse(model_class: type[StrictModel], body: Any) -> Any:
    """A validated request model, or APIError(400) naming the field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model_class.model_validate(refuse_unsupported(body, model_class.model_fields))
    except ValidationError as exc:
        raise _api_error(exc) from None
    except RecursionError:
        raise APIError("the request is nested too deeply") from None


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")


def guided_decoding_of(req: GuidedFields) -> Optional[GuidedDecodingParams]:
    """The request's structured-output constraint, checked (the schema, regex or grammar
    compiles), or None; APIError(400) naming the field otherwise."""
    given = [name for name in GUIDED_FIELDS if getattr(req, name) is not None
             and not (name == "response_format" and req.response_format.type == "text")]
    if not given:
        return None
    if len(given) > 1:
        raise APIError(f"at most one of {', '.join(GUIDED_FIELDS)} may be given; got "
                       f"{', '.join(given)}", param=given[1])
    name = given[0]
    try:
        params = _guided_params(name, getattr(req, name))
        from tokenweir.guided.grammar import compile_grammar  # loads llguidance when needed
        compile_grammar(params)
    except ValueError as exc:
        raise APIError(f"'{name}': {exc}", param=name) from None
    return params


def _guided_params(name: str, value: Any) -> GuidedDecodingParams:
    if name == "response_format":
        if value.type == "json_object":
            return GuidedDecodingParams(json_object=True)
        if value.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema': {'name': ..., "
                             "'schema': {...}}")
        return GuidedDecodingParams(json=value.json_schema.schema_)
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}[name]
    return GuidedDecodingParams(**{kind: value})


def refuse_unsupported(body: dict, supported: Iterable[str] = ()) -> dict:
    """`body` without the unsupported parameters that carry a neutral value; APIError for
    one that carries any other value. Names in `supported` (the request model's own fields)
    are left alone."""
    supported = frozenset(supported)
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if name in supported or value is None or any(_same(value, n) for n in neutral):
            continue
        raise APIError(f"'{name}' is not supported by tokenweir (only "
                       f"{_neutral_text(neutral)} is accepted)", param=name)
    return {k: v for k, v in body.items() if k not in UNSUPPORTED or k in supported}



def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or \
        isinstance(neutral, int) and isinstance(value, float) and value == neutral


def _neutral_text(neutral: tuple) -> str:
    return " or ".join(["null", *(repr(n) for n in neutral)])


def _api_error(exc: ValidationError) -> APIError:
    """The most specific error (deepest location) of a validation failure, as a 400."""
    errors = exc.errors(include_input=False, include_url=False)
    err = max(errors, key=lambda e: len(_field_path(e["loc"])))
    path = _field_path(err["loc"])
    param = str(path[0]) if path else None
    where = ".".join(str(p) for p in path)
    if err["type"] == "extra_forbidden":
        return APIError(f"unknown parameter '{where}': tokenweir does not support it",
                        param=param)
    if err["type"] == "missing":
        return APIError(f"'{where}' is required", param=param)
    if path == ["prompt"]:  # every branch of the union failed at the top
        return APIError("'prompt' must be a string or a non-empty list of token ids (or a "
                        "list holding one of those: one prompt per request)", param=param)
    return APIError(f"'{where}': {err['msg']}", param=param)


def _field_path(loc: tuple) -> list:
    """A location without pydantic's union-branch labels (`str`, `list[int]`, ...)."""
    return [p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _BRANCHES)]


_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "TextPart", "literal",
             "NamedToolChoice"}
