"""Turns engine-core outputs into user-facing RequestOutputs: incremental detokenization,
stop strings, logprobs and per-request metrics. Stop strings live here (they need text); when
one matches, the processor reports the request id so the engine finishes it.

A request that finished with an error (finish reason "error") carries the message in
`RequestOutput.error`. When processing itself fails for one request, the engine builds that
request's final output with `error_output`, which reads only the Request.

Parallel sampling (request.SampleGroup): each sample has its own state (detokenizer, stop
strings, logprobs), keyed by its request id; the group is one output, under the user's request
id (`output_id`), with a CompletionOutput per sample (`index` = the sample's). It is finished
when every sample is. A delta output carries the samples that changed since the last one (new
tokens, or a finish not yet shown). With best_of > n there is no partial output: one output
when all are finished, holding the n samples with the highest cumulative logprob, best first,
re-indexed 0..n-1 (vLLM's ranking).

`fold_step` is the one fold of a step's engine-core outputs into user outputs (one per request
or group), used by LLMEngine.step and by the serving path's output side alike; what differs
between them (finishing a request in the scheduler now, or asking the engine thread to) comes in
as two callbacks.

Deferred text (offline final-only steps; contract): a lone request with no stop strings and no
logprobs ("deferrable") has nothing in its text that a final-only step shows or acts on, so
such steps fold none of its tokens: `fold_step(final_only=True)` holds its unfinished one-token
outputs back, and the engine's bulk path (Scheduler.update_from_output's `decoded`) does not
even build them (`defer`); the state is then "lagging". The held tokens are fed to the same
incremental detokenizer, one at a time and in order, before anything reads the text: the
request's next output that is processed (its final one, or any step without final_only), or
an abort. So the text, the deltas and the U+FFFD hold-backs are exactly the every-step ones
(tests/engine/test_offline_outputs.py). What forces every-step folding: stop strings (they end
the request on the output side), logprobs (decoded per token), parallel sampling (groups show
every step), and any step without final_only (the served path never defers). A lagging
request's "error" output from a failure inside this processor shows the text folded so far."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from tokenweir import faults
from tokenweir.core.outputs import TokenLogprobs
from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenweir.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenweir.request import Request, SampleGroup

logger = logging.getLogger("tokenweir")

# on_stop(request): a stop string ended `request` (a sample, or a lone request) on the output
# side; the caller finishes it in the scheduler (status FINISHED_STOPPED).
OnStop = Callable[[Request], None]
# on_fail(request_ids, message): output processing failed for a request or group; the caller
# fails every one of these scheduler ids (a group's samples) with `message`, freeing blocks.
OnFail = Callable[[list[str], str], None]


@dataclass
class _RequestState:
    request: Request
    prompt: Optional[str]
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None  # None: not asked for
    ranks_only: bool = False  # logprobs come only to rank best_of samples: sum, keep none
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    last_token_time: Optional[float] = None
    new_text: str = ""  # text added by the latest update (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    changed: bool = False  # got an update since its group's last output
    finish_shown: bool = False  # its finish went out in a group output
    deferrable: bool = False  # its text may lag its tokens (module docstring: deferred text)
    num_folded: int = 0  # output tokens fed to the detokenizer
    lagging: bool = False  # output tokens past num_folded are in request.all_token_ids


@dataclass
class _GroupState:
    group: SampleGroup
    samples: list[_RequestState]  # by sample index

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def ranked(self) -> bool:
        """best_of > n: only the n best, and only when all are finished."""
        return self.group.size > self.group.params.n


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # By output id (the user's request id; a group's is its parent's): every request in
        # flight. A group's other samples are in `_samples`, its outputs built from `groups`.
        self.states: dict[str, _RequestState] = {}
        self.groups: dict[str, _GroupState] = {}
        self._samples: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: Optional[str]) -> None:
        """A request, or a group's parent (its samples come with it)."""
        group = request.group
        samples = [request] if group is None else group.samples
        states = [self._new_state(sample, prompt) for sample in samples]
        self.states[request.request_id] = states[0]
        if group is not None:
            self.groups[request.request_id] = _GroupState(group, states)
            self._samples.update((s.request.request_id, s) for s in states[1:])

    def _new_state(self, request: Request, prompt: Optional[str]) -> _RequestState:
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
        asked = (params if request.group is None else request.group.params).logprobs
        deferrable = request.group is None and not params.stop and params.logprobs is None
        request.needs_token_outputs = not deferrable
        return _RequestState(request=request, prompt=prompt, detokenizer=detok,
                             logprobs=[] if asked is not None else None,
                             ranks_only=asked is None and params.logprobs is not None,
                             deferrable=deferrable)

    @staticmethod
    def output_id(request: Request) -> str:
        """The id the request's outputs go out under (a sample's: its group's)."""
        return request.request_id if request.group is None else request.group.request_id

    # ---- one step ----------------------------------------------------------------------
    def fold_step(self, core_outputs: Iterable[EngineCoreOutput], now: float, *, delta: bool,
                  on_stop: OnStop, on_fail: OnFail, yield_gil: bool = False,
                  final_only: bool = False) -> dict[str, RequestOutput]:
        """One step's engine-core outputs -> {output id: RequestOutput}, one per request or
        parallel-sampling group that has something to show (in the order the step named them;
        a best_of group shows nothing until it is finished). `delta`: only what is new since
        the last output. A finished request's (group's) state is forgotten once its final
        output is built.

        Outputs of a request whose state is gone (ended here by a stop string, an error or an
        abort, while the engine computed another step for it) are dropped. When processing or
        building the output fails for one sample, its whole group fails alone: `on_fail` gets
        every sample's id and the group's final output is an "error" one (`error_output`).
        `yield_gil`: sleep(0) before each request, so that an engine thread running the next
        forward takes the GIL between requests (the output thread sets it). `final_only`: a
        lone request's output is built only when it finished (vLLM's FINAL_ONLY output kind,
        what offline generate needs: its tokens are still folded in every step, for stop
        strings); groups and error outputs are built as usual. A deferrable request's
        unfinished outputs are not even folded then (module docstring: deferred text)."""
        if final_only:
            core_outputs = self._hold_back(core_outputs, now)
        made: dict[str, Request | RequestOutput] = {}  # the request to build from, or final
        for core_output in core_outputs:
            request = core_output.request
            output_id = self.output_id(request)
            if output_id not in self.states or isinstance(made.get(output_id), RequestOutput):
                continue  # gone, or its group failed earlier in this step
            if yield_gil:
                time.sleep(0)
            try:
                if self.process(core_output, now):
                    request.finished_time = now
                    on_stop(request)
                made.setdefault(output_id, request)
            except Exception as exc:  # noqa: BLE001 - this request (group) alone fails
                made[output_id] = self._fail(request, exc, delta, on_fail)
        if final_only:
            made = {output_id: item for output_id, item in made.items()
                    if not self._unfinished_lone(output_id, item)}
        outputs = ((output_id, self._build(output_id, item, delta, on_fail))
                   for output_id, item in made.items())
        return {output_id: out for output_id, out in outputs if out is not None}

    def _hold_back(self, core_outputs: Iterable[EngineCoreOutput],
                   now: float) -> list[EngineCoreOutput]:
        """A final-only step's outputs less the ones whose folding waits: one token, not the
        last, of a deferrable request (its state then lags)."""
        states, kept = self.states, []
        for output in core_outputs:
            state = states.get(output.request.request_id)
            if (state is not None and state.deferrable and output.finish_reason is None
                    and len(output.new_token_ids) == 1):
                state.lagging, state.last_token_time = True, now
            else:
                kept.append(output)
        return kept

    def defer(self, request_ids: Iterable[str], now: float) -> None:
        """These deferrable requests got a token at `now` that no output carried (the bulk
        path, `decoded`): their text lags until it is read."""
        states = self.states
        for request_id in request_ids:
            state = states.get(request_id)
            if state is not None:
                state.lagging, state.last_token_time = True, now

    def _catch_up(self, state: _RequestState, held: int) -> None:
        """Fold a lagging state's tokens in order, one at a time as their steps would have,
        all but the last `held` (an output's own tokens, which _process folds next)."""
        state.lagging = False
        request = state.request
        ids = request.all_token_ids
        start, end = len(request.prompt_token_ids) + state.num_folded, len(ids) - held
        if start >= end:
            return
        if faults.ARMED:
            faults.fire("detokenize", request.request_id)
        state.text += state.detokenizer.add_each(ids[start:end])
        state.num_folded = end - len(request.prompt_token_ids)

    def _catch_up_shown(self, state: _RequestState) -> None:
        """Catch a lagging state up before it is shown without a new output (an abort): its
        last token is the latest update (new text and token ids), as if folded in its step."""
        self._catch_up(state, held=1)
        request = state.request
        if state.num_folded < len(request.all_token_ids) - len(request.prompt_token_ids):
            state.new_token_ids = request.all_token_ids[-1:]
            state.new_text = state.detokenizer.add_tokens(state.new_token_ids)
            state.text += state.new_text
            state.num_folded += 1

    def _unfinished_lone(self, output_id: str, item: Request | RequestOutput) -> bool:
        """A request outside any group, still running: its output would say nothing final."""
        if isinstance(item, RequestOutput) or output_id in self.groups:
            return False
        return self.states[output_id].finish_reason is None

    def _build(self, output_id: str, item: Request | RequestOutput, delta: bool,
               on_fail: OnFail) -> Optional[RequestOutput]:
        """The step's output of `output_id` (forgotten when final); `item` is a final error
        output already, or the request to build from."""
        if isinstance(item, RequestOutput):
            return item
        try:
            result = self.make_output(output_id, delta=delta)
        except Exception as exc:  # noqa: BLE001 - this request (group) alone fails
            return self._fail(item, exc, delta, on_fail)
        if result is not None and result.finished:
            self.pop(output_id)
        return result

    def _fail(self, request: Request, exc: Exception, delta: bool,
              on_fail: OnFail) -> RequestOutput:
        """Processing `request`'s output raised: fail it (a sample: its whole group) through
        `on_fail`, and build its final "error" output (the state is forgotten)."""
        message = f"processing the request's output failed: {exc!r}"
        samples = request.group.samples if request.group is not None else [request]
        on_fail([sample.request_id for sample in samples], message)
        if request.error is None:  # not failed by on_fail (it finished, or the fail is queued)
            logger.warning("request %s failed: %s", request.request_id, message)
            request.error = message
        return self.error_output(request, delta=delta)

    def process(self, output: EngineCoreOutput, now: float) -> bool:
        """Fold one step's tokens in. Returns True when a stop string ended the request
        (the caller must then finish it in the scheduler). An output for a sample already
        finished here (a stop string, one step before the scheduler learns of it) is
        dropped."""
        request_id = output.request.request_id
        state = self.states.get(request_id) or self._samples[request_id]
        if state.finish_reason is not None:
            return False
        if state.lagging:
            self._catch_up(state, held=len(output.new_token_ids))
        stopped = self._process(state, output, now)
        group = output.request.group
        if group is not None:
            state.changed = True
            if state.finish_reason is not None and not group.forked:
                self._finish_unforked(self.groups[group.request_id], state)
        return stopped

    @staticmethod
    def _finish_unforked(group: _GroupState, parent: _RequestState) -> None:
        """The parent finished before forking (abort, error): so did the other samples."""
        for state in group.samples[1:]:
            if state.finish_reason is None:
                state.finish_reason = parent.finish_reason

    def _process(self, state: _RequestState, output: EngineCoreOutput, now: float) -> bool:
        state.last_token_time = now
        state.new_token_ids = list(output.new_token_ids)
        if faults.ARMED:
            faults.fire("detokenize", output.request.request_id)
        delta = state.detokenizer.add_tokens(output.new_token_ids)
        state.num_folded += len(output.new_token_ids)
        if output.finish_reason is not None:
            delta += state.detokenizer.flush()  # a trailing partial UTF-8 character, if any
        if output.logprobs is not None and state.logprobs is not None:
            self._add_logprobs(state, output.new_token_ids[-1], output.logprobs)
        elif output.logprobs is not None and state.ranks_only:
            state.cumulative_logprob += output.logprobs.sampled_logprob
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

    def make_output(self, request_id: str, delta: bool = False) -> Optional[RequestOutput]:
        """The output so far of a request (or group) by its output id; `delta=True` gives only
        the latest text and tokens. None: a best_of group with nothing to show yet."""
        if faults.ARMED:
            faults.fire("output", request_id)
        group = self.groups.get(request_id)
        if group is not None:
            return self._group_output(group, delta)
        state = self.states[request_id]
        if state.lagging:
            self._catch_up_shown(state)
        request = state.request
        return RequestOutput(
            request_id=request_id, prompt=state.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[self._completion(state, 0, delta)],
            finished=state.finish_reason is not None, metrics=self._metrics([state]),
            num_cached_tokens=max(0, request.num_cached_tokens),
            error=request.error if state.finish_reason == "error" else None)

    @staticmethod
    def _completion(state: _RequestState, index: int, delta: bool) -> CompletionOutput:
        """`logprobs` is a snapshot of every position so far, delta or not (the server slices
        off what it has sent): the processor's own list grows on another thread."""
        return CompletionOutput(
            index=index,
            text=state.new_text if delta else state.text,
            token_ids=state.new_token_ids if delta else list(state.request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob
            if state.logprobs is not None or state.ranks_only else None,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason)

    @staticmethod
    def _metrics(states: list[_RequestState]) -> RequestMetrics:
        """A request's metrics; a group's are its parent's, with the latest token and finish
        of any sample and the preemptions of all."""
        request = states[0].request
        last = max((s.last_token_time for s in states if s.last_token_time is not None),
                   default=None)
        finished = [s.request.finished_time or (s.last_token_time if s.finish_reason else None)
                    for s in states]
        return RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, last_token_time=last,
            finished_time=None if None in finished else max(finished),
            num_preemptions=sum(s.request.num_preemptions for s in states))

    def _group_output(self, group: _GroupState, delta: bool) -> Optional[RequestOutput]:
        finished = group.finished
        if group.ranked and not finished:
            return None
        shown = [(i, s) for i, s in enumerate(group.samples) if not delta or group.ranked
                 or s.changed or (s.finish_reason is not None and not s.finish_shown)]
        for _, state in shown:
            state.changed, state.finish_shown = False, state.finish_reason is not None
        completions = [self._completion(s, i, delta and not group.ranked) for i, s in shown]
        if group.ranked:
            completions = _best(completions, group.group.params.n)
        parent = group.samples[0]
        request = parent.request
        errors = [s.request.error for s in group.samples if s.finish_reason == "error"]
        return RequestOutput(
            request_id=group.group.request_id, prompt=parent.prompt,
            prompt_token_ids=list(request.prompt_token_ids), outputs=completions,
            finished=finished, metrics=self._metrics(group.samples),
            num_cached_tokens=max(0, request.num_cached_tokens),
            error=next((e for e in errors if e), None))

    def error_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The final output of a request (or of the whole group of a sample) whose processing
        failed, finish reason "error" and `request.error` as the message. Built from the
        Requests (and the text already shown), never through the code that failed; the
        state is forgotten."""
        output_id = self.output_id(request)
        group = self.groups.get(output_id)
        states = group.samples if group is not None else [self.states.get(output_id)]
        samples = request.group.samples if request.group is not None else [request]
        self.pop(output_id)
        completions = [CompletionOutput(
            index=i, text=state.text if state is not None and not delta
            and isinstance(state.text, str) else "",
            token_ids=[] if delta else list(sample.output_token_ids), finish_reason="error")
            for i, (sample, state) in enumerate(zip(samples, states))]
        first = samples[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time, finished_time=request.finished_time,
            num_preemptions=sum(sample.num_preemptions for sample in samples))
        return RequestOutput(
            request_id=output_id, prompt=states[0].prompt if states[0] is not None else None,
            prompt_token_ids=list(request.prompt_token_ids), outputs=completions,
            finished=True, metrics=metrics, error=request.error)

    def abort(self, output_id: str, delta: bool = False) -> Optional[RequestOutput]:
        """The final output of a request (group) aborted by its output id: finish reason
        "abort" for every sample not finished yet; its state is forgotten. None: not in
        flight."""
        if output_id not in self.states:
            return None
        self._finish_aborted(output_id)
        try:
            return self.make_output(output_id, delta=delta)
        finally:
            self.pop(output_id)

    def _finish_aborted(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        states = group.samples if group is not None else [self.states.get(request_id)]
        for state in states:
            if state is not None and state.finish_reason is None:
                state.finish_reason = "abort"

    def pop(self, request_id: str) -> None:
        """Forget a request (or group) by its output id."""
        self.states.pop(request_id, None)
        group = self.groups.pop(request_id, None)
        if group is not None:
            for state in group.samples[1:]:
                self._samples.pop(state.request.request_id, None)


def _best(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n completions with the highest cumulative logprob (ties: lower index), best first,
    re-indexed 0..n-1."""
    ranked = sorted(completions, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    for index, completion in enumerate(ranked):
        completion.index = index
    return ranked
