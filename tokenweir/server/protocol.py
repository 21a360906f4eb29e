"""OpenAI request parsing (plus vLLM's extra sampling fields) and response shaping.

Parsing raises `APIError`; the app turns it into OpenAI's error JSON.
"""

from __future__ import annotations

import math
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


_MISSING = object()


def field(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    """body[name] checked against `kind` (None is treated as absent)."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(f"'{name}' must be of type {_names(kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be of type {_names(kinds)}, got "
                       f"{type(value).__name__}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number", param=name)
    return value


def _names(kinds: tuple) -> str:
    return " or ".join(k.__name__ for k in kinds)


@dataclass
class Parsed:
    params: SamplingParams
    priority: int
    ttft_slo_ms: Optional[float]
    stream: bool
    include_usage: bool
    top_logprobs: Optional[int]  # chat: top alternatives per token; completions: logprobs


def parse_sampling(body: dict, chat: bool) -> Parsed:
    """OpenAI fields plus vLLM extras; ValueError from SamplingParams becomes a 400."""
    n = field(body, "n", int, 1)
    if n != 1:
        raise APIError(f"only n=1 is supported, got n={n}", param="n")
    max_tokens = field(body, "max_tokens", int)
    if chat:
        max_tokens = field(body, "max_completion_tokens", int, max_tokens)
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's completions default
    stop = field(body, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    if chat:
        want = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int)
        if top is not None and not want:
            raise APIError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        if top is not None and not 0 <= top <= 20:
            raise APIError(f"'top_logprobs' must be in [0, 20], got {top}", param="top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = field(body, "logprobs", int)
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise APIError(f"'logprobs' must be in [0, 20], got {logprobs}", param="logprobs")
    stream_options = field(body, "stream_options", dict, {})
    stream = field(body, "stream", bool, False)
    try:
        params = SamplingParams(
            temperature=field(body, "temperature", float, 1.0),
            top_p=field(body, "top_p", float, 1.0),
            top_k=field(body, "top_k", int, 0),
            min_p=field(body, "min_p", float, 0.0),
            seed=field(body, "seed", int),
            max_tokens=max_tokens,
            min_tokens=field(body, "min_tokens", int, 0),
            stop=stop,
            stop_token_ids=field(body, "stop_token_ids", list),
            ignore_eos=field(body, "ignore_eos", bool, False),
            logprobs=logprobs,
            skip_special_tokens=field(body, "skip_special_tokens", bool, True),
            include_stop_str_in_output=field(body, "include_stop_str_in_output", bool, False))
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc)) from exc
    ttft = field(body, "ttft_slo_ms", float)
    if ttft is not None and ttft <= 0:
        raise APIError(f"'ttft_slo_ms' must be positive, got {ttft}", param="ttft_slo_ms")
    return Parsed(params=params, priority=field(body, "priority", int, 0), ttft_slo_ms=ttft,
                  stream=stream,
                  include_usage=bool(stream_options.get("include_usage", False)),
                  top_logprobs=logprobs)


def parse_prompt(body: dict) -> Any:
    """A completions prompt: a string, a list of token ids, or a one-element list of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return {"prompt_token_ids": prompt}
    raise APIError("'prompt' must be a string or a list of token ids (one prompt per request)",
                   param="prompt")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError("each message needs a 'role' and 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError("message 'content' must be a string or a list of text parts",
                           param="messages")
        out.append({"role": m["role"], "content": content})
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
