"""Input processing, torch-free: a prompt and its sampling params -> a validated, tokenized
Request (what `LLMEngine.make_request` does, and what the API process of `tokenweir serve
--engine-process` does without the engine: see engine/core_client.py).

Contract: `InputProcessor` is a mixin; its user sets `tokenizer` (None: only token-id prompts),
`vocab_size`, `max_model_len`, `eos_token_ids` and `_ids` (an id counter) before calling it.
Validation raises ValueError with a clear message and changes nothing.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from tokenweir.request import Request, SamplingParams, make_sample_group

PromptType = Union[str, list[int], dict[str, Any]]


def check_guided(params: SamplingParams, tokenizer: Any) -> None:
    """guided/grammar.py's check, imported (llguidance) only for a guided request."""
    if params.guided_decoding is not None:
        from tokenweir.guided.grammar import check_guided as check

        check(params, tokenizer)


def output_room(max_tokens: Optional[int], prompt_tokens: int, max_model_len: int) -> int:
    """The request's output cap: `max_tokens`, or all the room the context leaves when it is
    None. A max_tokens the context cannot hold is refused (ValueError naming both numbers, as
    vLLM answers 400), never clamped: the caller asked for something that cannot happen."""
    room = max_model_len - prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit the context: the prompt has {prompt_tokens} "
            f"tokens and max_model_len is {max_model_len}, which leaves room for {room} output "
            f"tokens; ask for max_tokens <= {room} (or leave it unset for all the room left)")
    return max_tokens


def _token_ids(ids: object, what: str) -> list[int]:
    """`ids` as a list of ints; ValueError naming `what` for anything else (a float, a string,
    a bool is not a token id)."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{what} must be a list of integers, got {type(ids).__name__}")
    for i, token_id in enumerate(ids):
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError(f"{what} must be a list of integers; element {i} is {token_id!r:.40}")
    return list(ids)


class InputProcessor:
    """make_request / check_params over the attributes the module docstring names."""

    def make_request(self, prompt: PromptType, params: SamplingParams,
                     request_id: Optional[str] = None, priority: int = 0,
                     arrival_time: Optional[float] = None, ttft_slo_ms: Optional[float] = None,
                     deadline: Optional[float] = None, tpot_slo_ms: Optional[float] = None
                     ) -> tuple[Request, Optional[str]]:
        """Validate and tokenize; raises ValueError with a clear message and changes nothing.
        `ttft_slo_ms` (after arrival) or `deadline` (absolute, engine clock) set a TTFT target,
        `tpot_slo_ms` a TPOT target (mean ms per output token after the first)."""
        text, token_ids = self._tokenize(prompt)
        self.check_params(params)
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is required")
        if ttft_slo_ms is not None and ttft_slo_ms <= 0:
            raise ValueError(f"ttft_slo_ms must be positive, got {ttft_slo_ms}")
        if tpot_slo_ms is not None and tpot_slo_ms <= 0:
            raise ValueError(f"tpot_slo_ms must be positive, got {tpot_slo_ms}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: prompt + at least one output token must fit")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = output_room(params.max_tokens, len(token_ids), self.max_model_len)
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=token_ids, sampling_params=params, max_tokens=max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority, eos_token_ids=self.eos_token_ids, ttft_slo_ms=ttft_slo_ms,
            deadline=deadline, tpot_slo_ms=tpot_slo_ms)
        make_sample_group(request)  # n / best_of > 1: the parent of its samples
        return request, text

    def check_params(self, params: SamplingParams) -> None:
        """ValueError naming the field for anything these params or this model refuse."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params.validate()
        params.check_vocab(self.vocab_size)
        check_guided(params, self.tokenizer)

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids); ValueError for anything that is not a prompt."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
                return text, _token_ids(prompt["prompt_token_ids"], "'prompt_token_ids'")
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' (a string) or 'prompt_token_ids' "
                             f"(a list of token ids); got keys {sorted(map(str, prompt))}")
        if isinstance(prompt, list):
            return None, _token_ids(prompt, "a token-id prompt")
        raise ValueError(f"a prompt is a string, a list of token ids, or a dict with 'prompt' "
                         f"or 'prompt_token_ids'; got {type(prompt).__name__}")
