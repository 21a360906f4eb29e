"""From validated request models to the engine's SamplingParams, and response shaping
(logprobs, usage, delta accumulation). `APIError` is what every refusal raises; the app turns
it into OpenAI's error JSON."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from tokenweir.outputs import Logprob, RequestOutput
from tokenweir.request import SamplingParams


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Parsed:
    params: SamplingParams
    priority: int
    ttft_slo_ms: Optional[float]
    stream: bool
    include_usage: bool
    top_logprobs: Optional[int]  # chat: top alternatives per token; completions: logprobs


def sampling(req: Any, chat: bool, vocab_size: int) -> Parsed:
    """The engine's view of a validated request model (tokenweir.server.models): OpenAI's
    fields with their defaults, plus vLLM's extras. APIError(400) naming the field for what
    only the engine's state can tell (a token id outside the vocabulary) or SamplingParams
    refuses."""
    if req.n not in (None, 1):
        raise APIError(f"only n=1 is supported, got n={req.n}", param="n")
    stop_ids = req.stop_token_ids or []
    bad = next((t for t in stop_ids if t >= vocab_size), None)
    if bad is not None:
        raise APIError(f"'stop_token_ids': token id {bad} is outside the vocabulary "
                       f"[0, {vocab_size})", param="stop_token_ids")
    try:
        params = SamplingParams(**_sampling_kwargs(req, chat))
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_field_named(str(exc))) from exc
    stream_options = req.stream_options
    return Parsed(params=params, priority=req.priority or 0, ttft_slo_ms=req.ttft_slo_ms,
                  stream=bool(req.stream),
                  include_usage=bool(stream_options and stream_options.include_usage),
                  top_logprobs=params.logprobs)


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


_PLAIN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output")


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
    """Chat messages as the template wants them: role and text content."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({"role": m.role, "content": content or ""})
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
    """Folds a request's delta outputs together: text, token ids, logprobs, finish."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.num_logprobs_seen = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.prompt_tokens = 0

    def add(self, out: RequestOutput) -> tuple[str, list[int], list]:
        """Returns this delta's (text, token_ids, logprob entries)."""
        c = out.outputs[0]
        self.prompt_tokens = len(out.prompt_token_ids)
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        entries: list = []
        if c.logprobs is not None:
            entries = c.logprobs[self.num_logprobs_seen:]
            self.num_logprobs_seen = len(c.logprobs)
        if out.finished:
            self.finish_reason = c.finish_reason
            self.stop_reason = c.stop_reason
        return c.text, list(c.token_ids), entries


def now() -> int:
    return int(time.time())
