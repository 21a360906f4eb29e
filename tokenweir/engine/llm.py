"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from tokenweir.config import DEFAULT_MODEL, EngineConfig
from tokenweir.engine.llm_engine import LLMEngine, PromptType
from tokenweir.outputs import RequestOutput
from tokenweir.request import SamplingParams

Params = Union[SamplingParams, Sequence[SamplingParams], None]


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

        Every prompt is validated before any is queued: a bad one raises ValueError and
        leaves the engine as it was.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        made = [engine.make_request(p, sp, priority=pr)
                for p, sp, pr in zip(prompts, params, priorities)]
        for request, text in made:
            engine.add_request(request, text)
        return self._run([r.request_id for r, _ in made], use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Params = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, rendered
        through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self):
        """Counters, gauges and histograms named as vLLM's, under the `tokenweir:` prefix."""
        return self.llm_engine.get_metrics()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while pending:
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_requests(pending)  # leave the engine clean for the next call
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)


def _as_params_list(params: Params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
