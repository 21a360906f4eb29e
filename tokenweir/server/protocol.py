"""From validated request models to the engine's SamplingParams, and response shaping
(logprobs, usage, delta accumulation). `APIError` is what every refusal raises; the app turns
it into OpenAI's error JSON."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from tokenweir.engine.engine_core import error_http_status
from tokenweir.outputs import CompletionOutput, Logprob, RequestOutput
from tokenweir.request import SamplingParams
from tokenweir.server.errors import APIError  # also raised by the routes as P.APIError


@dataclass
class Parsed:
    params: SamplingParams
    priority: int
    ttft_slo_ms: Optional[float]
    stream: bool
    include_usage: bool
    top_logprobs: Optional[int]  # chat: top alternatives per token; completions: logprobs
    tpot_slo_ms: Optional[float] = None  # mean ms per output token after the first (slo)


def sampling(req: Any, chat: bool, vocab_size: int) -> Parsed:
    """The engine's view of a validated request model (tokenweir.server.models): OpenAI's
    fields with their defaults, plus vLLM's extras. APIError(400) naming the field for what
    only the engine's state can tell (a token id outside the vocabulary) or SamplingParams
    refuses."""
    if req.stream and req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError("'best_of' cannot be streamed: the best n samples are known only once "
                       "all best_of have finished (as in vLLM)", param="best_of")
    stop_ids = req.stop_token_ids or []
    bad = next((t for t in stop_ids if t >= vocab_size), None)
    if bad is not None:
        raise APIError(f"'stop_token_ids': token id {bad} is outside the vocabulary "
                       f"[0, {vocab_size})", param="stop_token_ids")
    try:
        params = SamplingParams(**_sampling_kwargs(req, chat),
                                logit_bias=logit_bias_of(req, vocab_size))
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_field_named(str(exc))) from exc
    stream_options = req.stream_options
    return Parsed(params=params, priority=req.priority or 0, ttft_slo_ms=req.ttft_slo_ms,
                  stream=bool(req.stream),
                  include_usage=bool(stream_options and stream_options.include_usage),
                  top_logprobs=params.logprobs, tpot_slo_ms=req.tpot_slo_ms)


def logit_bias_of(req: Any, vocab_size: int) -> Optional[dict[int, float]]:
    """The validated request's logit_bias as {token id: bias}; APIError naming logit_bias
    for a token outside the vocabulary."""
    if not req.logit_bias:
        return None
    bias = {int(key): float(value) for key, value in req.logit_bias.items()}
    bad = next((t for t in bias if t >= vocab_size), None)
    if bad is not None:
        raise APIError(f"'logit_bias': token id {bad} is outside the vocabulary "
                       f"[0, {vocab_size})", param="logit_bias")
    return bias

def _sampling_kwargs(req: Any, chat: bool) -> dict:
    if chat:
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        logprobs = req.logprobs
    given = {name: getattr(req, name) for name in _PLAIN_FIELDS}
    from tokenweir.server.models import guided_decoding_of  # models imports this module
    return {**{k: v for k, v in given.items() if v is not None},
            "max_tokens": max_tokens, "logprobs": logprobs,
            "guided_decoding": guided_decoding_of(req)}


_PLAIN_FIELDS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                 "stop",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output",
                 "presence_penalty", "frequency_penalty", "repetition_penalty")


def _field_named(message: str) -> Optional[str]:
    """The SamplingParams field a ValueError's message starts with, if any."""
    word = message.split(" ", 1)[0].strip("'\"(:")
    return word if word in SamplingParams.__dataclass_fields__ else None


def prompt_of(req: Any) -> Any:
    """A completions prompt for the engine: a string or {"prompt_token_ids": [...]}."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def messages_of(req: Any) -> list[dict]:
    """Chat messages as the template wants them: role and text content (plus, when given,
    name, tool_call_id and tool_calls with their arguments as objects)."""
    from tokenweir.server.tool_calls import arguments_as_objects

    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(m, key, None) is not None:
                message[key] = getattr(m, key)
        if getattr(m, "tool_calls", None):
            message["tool_calls"] = arguments_as_objects([c.model_dump() for c in m.tool_calls])
        out.append(message)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---- logprobs ----------------------------------------------------------------------------
def _sampled(entry: dict[int, Logprob], token_id: int) -> Logprob:
    return entry.get(token_id) or Logprob(float("-inf"))


def _alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None),
                    key=lambda x: x[1].rank)
    return ranked[:k]


def _tok(tokenizer, token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]],
                        k: int, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        lp = _sampled(entry, token_id)
        text = _tok(tokenizer, token_id, lp)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({_tok(tokenizer, t, a): a.logprob for t, a in _alternatives(entry, k)}
                    if k else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]],
                  k: int) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        lp = _sampled(entry, token_id)
        text = _tok(tokenizer, token_id, lp)
        content.append({
            "token": text, "logprob": max(lp.logprob, -9999.0),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (s := _tok(tokenizer, t, a)),
                              "logprob": max(a.logprob, -9999.0),
                              "bytes": list(s.encode("utf-8"))}
                             for t, a in _alternatives(entry, k)]})
    return {"content": content}


class Accumulator:
    """Folds one choice's delta outputs together: text, token ids, logprobs, finish."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.num_logprobs_seen = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.error: Optional[str] = None  # the engine's message when finish_reason is "error"
        self.prompt_tokens = 0

    def add(self, out: RequestOutput, c: CompletionOutput) -> tuple[str, list[int], list]:
        """Fold in `c`, this choice's part of `out`; returns this delta's (text, token_ids,
        logprob entries)."""
        self.prompt_tokens = len(out.prompt_token_ids)
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        entries: list = []
        if c.logprobs is not None:
            entries = c.logprobs[self.num_logprobs_seen:]
            self.num_logprobs_seen = len(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
            self.stop_reason = c.stop_reason
            self.error = out.error
        return c.text, list(c.token_ids), entries

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Choices:
    """The Accumulators of one answer's choices (n of them), by index."""

    def __init__(self) -> None:
        self.by_index: dict[int, Accumulator] = {}

    def of(self, index: int) -> Accumulator:
        if index not in self.by_index:
            self.by_index[index] = Accumulator(index)
        return self.by_index[index]

    def in_order(self) -> list[Accumulator]:
        return [self.by_index[i] for i in sorted(self.by_index)] or [Accumulator()]

    def usage(self) -> dict:
        """The prompt once, the completion tokens of every choice."""
        accs = self.in_order()
        return usage(accs[0].prompt_tokens, sum(len(a.token_ids) for a in accs))

    def failed(self) -> Optional["APIError"]:
        """The error of the first choice that failed in the engine, if any."""
        return next(filter(None, map(request_failed, self.in_order())), None)


def request_failed(acc: Accumulator) -> Optional[APIError]:
    """The error a finished request's answer carries (finish_reason "error"), as vLLM and
    OpenAI send it: 400 when the engine refused the request as invalid, else 500."""
    if acc.finish_reason != "error":
        return None
    message = acc.error or "the request failed in the engine"
    status = error_http_status(acc.error)
    return APIError(message, status, "invalid_request_error" if status == 400
                    else "internal_error")


def now() -> int:
    return int(time.time())
