"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar, Union

from tokenweir.config import DEFAULT_MODEL, EngineConfig
from tokenweir.engine.llm_engine import LLMEngine, PromptType
from tokenweir.outputs import RequestOutput
from tokenweir.request import SamplingParams

Params = Union[SamplingParams, Sequence[SamplingParams], None]
T = TypeVar("T")


class LLM:
    """Keyword arguments are vLLM's engine arguments (see `tokenweir.config`)."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Params = None, priority: Optional[Sequence[int]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        Every argument is validated before any request is queued: a wrong type raises
        TypeError, a bad value ValueError, each naming the argument (`prompts[2]`,
        `sampling_params[0]`, ...), and the engine is left as it was. A request that fails
        later, inside the engine, comes back finished with finish_reason 'error' and the
        message in `RequestOutput.error`; the others are unaffected.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        engine = self.llm_engine
        for i, sp in enumerate(params):
            _name_errors(f"sampling_params[{i}]", lambda: engine.check_params(sp))
        made = [_name_errors(f"prompts[{i}]", lambda: engine.make_request(p, sp, priority=pr))
                for i, (p, sp, pr) in enumerate(zip(prompts, params, priorities))]
        added: list[str] = []
        try:
            for request, text in made:
                engine.add_request(request, text)
                added.append(request.request_id)
        except BaseException:
            self._abandon(added)  # all or nothing: leave the engine as it was
            raise
        return self._run(added, use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Params = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             tools: Optional[list[dict]] = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, rendered
        through the model's chat template (with `tools`, OpenAI-shaped tool definitions, when
        given: ValueError if the template does not take them). Tool calls are not parsed."""
        conversations = _as_conversations(messages)
        tokenizer = self.llm_engine.tokenizer
        extra = {} if tools is None else {"tools": tools}
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                 **extra)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self):
        """Counters, gauges and histograms named as vLLM's, under the `tokenweir:` prefix."""
        return self.llm_engine.get_metrics()

    def _abandon(self, request_ids) -> None:
        """Abort these requests (their outputs are forgotten)."""
        self.llm_engine.abort_requests(request_ids)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else _NoBar()
        try:
            while pending:
                for output in engine.step(final_only=True):
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self._abandon(pending)  # leave the engine clean for the next call
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]


def _progress_bar(total: int):
    from tqdm import tqdm  # imported only when shown (~0.07 s of a start)

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


class _NoBar:
    """What `_run` calls on a progress bar, doing nothing (use_tqdm=False)."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _name_errors(name: str, make: Callable[[], T]) -> T:
    """Run `make`; a ValueError it raises is re-raised with `name` in front of its message."""
    try:
        return make()
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _as_prompt_list(prompts: object) -> list[PromptType]:
    """One prompt (a string, a dict, or a list of token ids) or a list/tuple of them."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, a dict with 'prompt' "
                        f"or 'prompt_token_ids', or a list of those; got "
                        f"{type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, dict, list)):
            raise TypeError(f"prompts[{i}] must be a string, a list of token ids or a dict; "
                            f"got {type(prompt).__name__}")
    return list(prompts)


def _as_params_list(params: Params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(params).__name__}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got "
                            f"{type(p).__name__}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)


def _as_priority_list(priority: Optional[Sequence[int]], n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if not isinstance(priority, (list, tuple)):
        raise TypeError(f"priority must be a list of integers, got {type(priority).__name__}")
    for i, value in enumerate(priority):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"priority[{i}] must be an integer, got {value!r}")
    if len(priority) != n:
        raise ValueError(f"got {len(priority)} priorities for {n} prompts")
    return list(priority)


def _as_conversations(messages: object) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts or "
                        f"a list of such lists; got {messages!r:.60}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"messages[{i}] must be a non-empty list of message dicts")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise TypeError(f"message {j} of conversation {i} must be a dict with 'role' "
                                f"and 'content'; got {message!r:.60}")
    return conversations
