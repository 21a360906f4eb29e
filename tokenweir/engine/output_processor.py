"""Turns engine-core outputs into user-facing RequestOutputs: incremental detokenization,
stop strings, logprobs and per-request metrics. Stop strings live here (they need text); when
one matches, the processor reports the request id so the engine finishes it.

A request that finished with an error (finish reason "error") carries the message in
`RequestOutput.error`. When processing itself fails for one request, the engine builds that
request's final output with `error_output`, which reads only the Request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenweir import faults
from tokenweir.core.outputs import TokenLogprobs
from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenweir.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenweir.request import Request


@dataclass
class _RequestState:
    request: Request
    prompt: Optional[str]
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    last_token_time: Optional[float] = None
    new_text: str = ""  # text added by the latest update (for streaming)
    new_token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: Optional[str]) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
        self.states[request.request_id] = _RequestState(
            request=request, prompt=prompt, detokenizer=detok,
            logprobs=[] if params.logprobs is not None else None)

    def process(self, output: EngineCoreOutput, now: float) -> bool:
        """Fold one step's tokens in. Returns True when a stop string ended the request
        (the caller must then finish it in the scheduler)."""
        state = self.states[output.request.request_id]
        state.last_token_time = now
        state.new_token_ids = list(output.new_token_ids)
        if faults.ARMED:
            faults.fire("detokenize", output.request.request_id)
        delta = state.detokenizer.add_tokens(output.new_token_ids)
        if output.finish_reason is not None:
            delta += state.detokenizer.flush()  # a trailing partial UTF-8 character, if any
        if output.logprobs is not None and state.logprobs is not None:
            self._add_logprobs(state, output.new_token_ids[-1], output.logprobs)
        stopped_by_string = self._append_text(state, delta)
        if stopped_by_string:
            state.finish_reason = "stop"
        elif output.finish_reason is not None:
            state.finish_reason = output.finish_reason
            state.stop_reason = output.request.stop_reason
        return stopped_by_string

    def _append_text(self, state: _RequestState, delta: str) -> bool:
        params = state.request.sampling_params
        before = len(state.text)
        state.text += delta
        if faults.ARMED:
            faults.fire("stop", state.request.request_id)
        stop = self._find_stop(state.text, len(delta), params.stop)
        if stop is None:
            state.new_text = delta
            return False
        index, stop_str = stop
        end = index + len(stop_str) if params.include_stop_str_in_output else index
        state.text = state.text[:end]
        state.new_text = state.text[before:]
        state.stop_reason = stop_str
        return True

    @staticmethod
    def _find_stop(text: str, delta_len: int, stops: list[str]) -> Optional[tuple[int, str]]:
        """Earliest stop string that overlaps the newly added text."""
        best: Optional[tuple[int, str]] = None
        for stop_str in stops:
            start = max(0, len(text) - delta_len - len(stop_str) + 1)
            index = text.find(stop_str, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop_str)
        return best

    def _add_logprobs(self, state: _RequestState, token_id: int, lp: TokenLogprobs) -> None:
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(lp.sampled_logprob, lp.sampled_rank, decode([token_id]))}
        for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            entry.setdefault(tid, Logprob(value, rank, decode([tid])))
        state.logprobs.append(entry)
        state.cumulative_logprob += lp.sampled_logprob

    def make_output(self, request_id: str, delta: bool = False) -> RequestOutput:
        """The request's output so far; `delta=True` gives only the latest text and tokens."""
        if faults.ARMED:
            faults.fire("output", request_id)
        state = self.states[request_id]
        request = state.request
        completion = CompletionOutput(
            index=0,
            text=state.new_text if delta else state.text,
            token_ids=state.new_token_ids if delta else list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs, finish_reason=state.finish_reason,
            stop_reason=state.stop_reason)
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, last_token_time=state.last_token_time,
            finished_time=request.finished_time or (state.last_token_time
                                                     if state.finish_reason else None),
            num_preemptions=request.num_preemptions)
        return RequestOutput(
            request_id=request_id, prompt=state.prompt,
            prompt_token_ids=list(request.prompt_token_ids), outputs=[completion],
            finished=state.finish_reason is not None, metrics=metrics,
            num_cached_tokens=max(0, request.num_cached_tokens),
            error=request.error if state.finish_reason == "error" else None)

    def error_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The final output of a request whose processing failed, finish reason "error" and
        `request.error` as the message. Built from the Request (and the text already shown),
        never through the code that failed; the request's state is forgotten."""
        state = self.states.pop(request.request_id, None)
        text = state.text if state is not None and not delta else ""
        completion = CompletionOutput(
            index=0, text=text if isinstance(text, str) else "",
            token_ids=[] if delta else list(request.output_token_ids), finish_reason="error")
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, finished_time=request.finished_time,
            num_preemptions=request.num_preemptions)
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt if state is not None else None,
            prompt_token_ids=list(request.prompt_token_ids), outputs=[completion],
            finished=True, metrics=metrics, error=request.error)

    def finish_aborted(self, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is not None and state.finish_reason is None:
            state.finish_reason = "abort"

    def pop(self, request_id: str) -> None:
        self.states.pop(request_id, None)
