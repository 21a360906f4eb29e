"""Requests as the scheduler sees them: token counts, status, sampling parameters.

No torch here: the scheduler, the KV cache manager and the simulator all share these objects.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

# The error message of a request that failed through its own fault starts with this: one
# refused at admission for a bad value (a ValueError: prompt + max_tokens over max_model_len, a
# duplicate id), or a grammar no token of the model can continue (guided/decoder.py). The
# client's error (HTTP 400, engine/engine_core.py:error_http_status); every other failure
# (sampling, stop rules, output, the forward) is the server's (500).
INVALID_REQUEST = "invalid request"


class RequestStatus(enum.IntEnum):
    """Ordered: every status greater than PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # handling this request failed; `Request.error` says why

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> Optional[str]:
        """vLLM's names: 'stop', 'length', 'abort' (and 'error'); None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_INT64_MAX = 2**63 - 1
MAX_SAMPLES = 256  # most samples (n, best_of) one request may ask for


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: object) -> str:
    """repr(value), shortened: a message must not echo a 400-digit number."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _check_int(name: str, value: object, low: int, high: int = _INT64_MAX) -> None:
    """`value` is an int (not a bool) in [low, high]; else ValueError naming `name`."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {_show(value)} "
                         f"({type(value).__name__})")
    if not low <= value <= high:
        bounds = f"{low}" if low == high else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {_show(value)}")


def _check_real(name: str, value: object, low: float, high: float = math.inf,
                low_open: bool = False) -> None:
    """`value` is a finite int or float in [low, high] ((low, high] with low_open)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {_show(value)} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        if high == math.inf:
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"in {interval}"
        raise ValueError(f"{name} must be {interval}, got {_show(value)}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_show(value)}")


def _as_stop_list(stop: object) -> list[str]:
    """None, one string, or a list/tuple of non-empty strings -> a list of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {_show(stop)}")
    for i, item in enumerate(stop):
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop[{i}] must be a non-empty string, got {_show(item)}")
    return list(stop)


def _as_token_id_list(name: str, ids: object) -> list[int]:
    """None or a list/tuple of non-negative int token ids -> a list of ints."""
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {_show(ids)}")
    for i, token_id in enumerate(ids):
        _check_int(f"{name}[{i}]", token_id, 0)
    return list(ids)


# ---- guided decoding (structured output) ---------------------------------------------------
@dataclass
class GuidedDecodingParams:
    """Constrain a request's output to a grammar, as vLLM's GuidedDecodingParams does. Exactly
    one field is set:

    - `json`: a JSON schema (a dict, or its JSON text); the output is one JSON value that
      validates against it;
    - `json_object`: True: the output is any JSON object;
    - `regex`: the output matches this regular expression (Rust `regex` syntax, anchored at
      both ends);
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a context-free grammar, in Lark syntax or llama.cpp's GBNF (`root ::= ...`).

    Construction checks the shape only (which field, which types); whether the schema, regex
    or grammar compiles is checked by the engine when the request is made (tokenweir/guided),
    with a ValueError naming the field. The output ends with the model's EOS token, which the
    grammar allows only where the text is complete.
    """

    json: Optional[str | dict] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """The one field that is set: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        return next(name for name in _GUIDED_KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def validate(self) -> None:
        """Raise ValueError naming the field (`guided_decoding.<field>`)."""
        given = [name for name in _GUIDED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("guided_decoding must set exactly one of "
                             f"{', '.join(_GUIDED_KINDS)}; got {given or 'none'}")
        kind, spec = given[0], getattr(self, given[0])
        where = f"guided_decoding.{kind}"
        if kind == "json" and not isinstance(spec, (str, dict)):
            raise ValueError(f"{where} must be a JSON schema (an object or its JSON text), got "
                             f"{_show(spec)}")
        if kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
            raise ValueError(f"{where} must be a non-empty string, got {_show(spec)}")
        if kind == "json_object" and spec is not True:
            raise ValueError(f"{where} must be true or null, got {_show(spec)}")
        if kind == "choice":
            if not isinstance(spec, list) or not spec:
                raise ValueError(f"{where} must be a non-empty list of strings, got "
                                 f"{_show(spec)}")
            for i, item in enumerate(spec):
                if not isinstance(item, str) or not item:
                    raise ValueError(f"{where}[{i}] must be a non-empty string, got "
                                     f"{_show(item)}")


_GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls, named as vLLM names them.

    `temperature == 0` means greedy. `seed` makes random sampling reproducible per request
    whatever else shares the batch. `logprobs=n` returns the top-n log-probabilities of every
    sampled token (plus the sampled one's).

    Parallel sampling: `n` samples of one prompt come back in one RequestOutput; with
    `best_of` (>= n), best_of samples are drawn and the n with the highest cumulative logprob
    are kept. Sample i of a request seeded with `seed` draws from the random stream of a lone
    request (n=1) seeded with `seed + i`, whatever the other samples do. Its tokens are that
    request's only while the logits are bit-identical, which a batched and a lone forward need
    not be (from some token on a sample may diverge: 0.875-0.938 of samples were identical in
    issue 34's check). The samples share the prompt's KV blocks (see
    `SampleGroup`). best_of > 1 needs random sampling (temperature > 0), as in vLLM.

    Contract: construction (and `validate()`, which the engine calls again when a request is
    made) checks every field's type and range, NaN and infinities included, and raises
    ValueError naming the field; a SamplingParams that validates cannot make the sampler or
    the stop rules fail. Ranges that need the model (stop_token_ids inside the vocabulary)
    are checked by the engine when the request is made.
    """

    n: int = 1
    best_of: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Sequence[str] | str] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # ---- penalties and bias (issue 15), applied in model/sampler.py ----
    # OpenAI's: subtract presence_penalty once from every token already in the output, and
    # frequency_penalty times its count there. vLLM's repetition_penalty (transformers' rule)
    # divides a positive logit of a token seen in the prompt or the output, multiplies a
    # negative one. logit_bias: token id -> a value added to its logit.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    # ---- guided decoding (structured output): see GuidedDecodingParams ----
    guided_decoding: Optional[GuidedDecodingParams] = None

    def __post_init__(self) -> None:
        self.stop = _as_stop_list(self.stop)
        self.stop_token_ids = _as_token_id_list("stop_token_ids", self.stop_token_ids)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field; called on construction."""
        _check_int("n", self.n, 1, MAX_SAMPLES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n, MAX_SAMPLES)
        _check_real("temperature", self.temperature, 0.0)
        if self.best_of is not None and self.best_of > 1 and self.temperature == 0.0:
            raise ValueError(f"best_of must be 1 with greedy sampling (temperature 0), got "
                             f"best_of={self.best_of}")
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            # sample i draws with seed + i (parallel sampling): every one must be a valid seed
            _check_int("seed", self.seed, -_INT64_MAX - 1, 2**64 - self.num_samples)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        _as_stop_list(self.stop)  # still a list of non-empty strings (fields are mutable)
        _as_token_id_list("stop_token_ids", self.stop_token_ids)
        self._validate_penalties()
        self._validate_guided()

    def _validate_penalties(self) -> None:
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                             f"{_show(self.logit_bias)}")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias key", token_id, 0)
            _check_real(f"logit_bias value of token {token_id}", bias, -100.0, 100.0)

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler has penalty or bias work to do for this request."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))

    def _validate_guided(self) -> None:
        """Guided decoding ends a request with EOS where the grammar is complete, so it
        cannot be combined with ignore_eos."""
        if self.guided_decoding is None:
            return
        if not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got "
                             f"{type(self.guided_decoding).__name__}")
        self.guided_decoding.validate()
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with guided_decoding: the grammar "
                             "ends the output with EOS")

    def check_vocab(self, vocab_size: int) -> None:
        """stop_token_ids and logit_bias keys must name tokens of a vocabulary of `vocab_size` tokens."""
        for i, token_id in enumerate(self.stop_token_ids):
            if token_id >= vocab_size:
                raise ValueError(f"stop_token_ids[{i}] = {token_id} is outside the "
                                 f"vocabulary [0, {vocab_size})")
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias key {token_id} is outside the vocabulary "
                                 f"[0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Samples drawn for the request: best_of when given, else n."""
        return self.n if self.best_of is None else self.best_of

    def for_sample(self, index: int) -> "SamplingParams":
        """The params sample `index` of a parallel-sampling request runs with: one sample
        (n=1), seed + index when seeded, and (for best_of > n) logprobs on, as the ranking
        needs each sampled token's logprob."""
        logprobs = self.logprobs
        if logprobs is None and self.num_samples > self.n:
            logprobs = 0
        return replace(self, n=1, best_of=None, logprobs=logprobs,
                       seed=None if self.seed is None else self.seed + index)


@dataclass(slots=True, eq=False)
class Request:
    """One request's scheduling state.

    Invariants: 0 <= num_computed_tokens <= num_tokens; `all_token_ids` is the prompt followed
    by every output token sampled so far (output tokens survive preemption).
    `max_tokens` is already capped so that prompt + output never exceeds max_model_len.
    Identity is the object: two requests are equal only if they are the same request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # High-water mark of num_computed_tokens, kept from the first preemption on: exact for a
    # request that was ever preempted (preemption.py sets it, the update raises it); for one
    # never preempted it may lag (it is num_computed_tokens then: it only grew).
    max_computed_tokens: int = 0
    num_preemptions: int = 0
    # The length below which the scheduler's decode fast path appends a token without the stop
    # rules (core/sched/stop.py: fast_length_cap); set when the scheduler takes the request.
    fast_length_cap: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    stop_reason: Optional[int | str] = None
    # TTFT target: `ttft_slo_ms` after arrival, or an absolute `deadline` (engine clock); the
    # explicit deadline wins. Read by the "slo" scheduling policy (core/sched/slo.py).
    ttft_slo_ms: Optional[float] = None
    deadline: Optional[float] = None
    # TPOT target: the mean seconds per output token after the first, in ms (None: the
    # scheduler config's `slo_tpot_ms`, if any). Read by the "slo" policy's step budget.
    tpot_slo_ms: Optional[float] = None
    num_slo_preemptions: int = 0  # times paused or cut for a more urgent request
    num_slo_pauses: int = 0  # of those, the pauses between steps (no work lost)
    # Timestamps the engine fills in (seconds, engine clock); policy reads them, never time.time().
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Why handling this request failed (status FINISHED_ERROR); None otherwise.
    error: Optional[str] = None
    # Parallel sampling (n / best_of > 1): the group this request is sample `sample_index` of.
    group: Optional["SampleGroup"] = None
    sample_index: int = 0
    # True: each token must come back as an EngineCoreOutput (the engine folds it at once:
    # stop strings, logprobs, parallel sampling). False: a decode no stop rule ends may be
    # listed by id instead (Scheduler.update_from_output's `decoded`: the simulator, and
    # offline steps whose text waits for the request's end; engine/output_processor.py).
    needs_token_outputs: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def max_num_tokens(self) -> int:
        """The longest this request can ever become: prompt + max_tokens."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def ttft_deadline(self) -> Optional[float]:
        """The absolute time the first token is due by, or None (no TTFT target)."""
        if self.deadline is not None:
            return self.deadline
        if self.ttft_slo_ms is not None:
            return self.arrival_time + self.ttft_slo_ms / 1000.0
        return None

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __hash__(self) -> int:
        return id(self)


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The samples of one parallel-sampling request (SamplingParams n or best_of > 1).

    Contract: `samples[0]` is the parent, the only one handed to the scheduler; its request id
    is the user's, and sample i > 0 is named `f"{request_id}#{i}"`. The parent prefills the
    prompt alone and samples its first token; in that step's update the scheduler forks the
    other samples (`forked` turns True): each shares the parent's KV blocks (ref counts) and
    owes one token, the prompt's last, whose logits give it its own first token; its first
    write copies the shared last block (copy-on-write). After the fork every sample is an
    ordinary request: preempting one frees only its own blocks and it recomputes like any
    preempted request (its prompt's full blocks are prefix-cache hits when caching is on).
    If the parent finishes before the fork (abort, error), the other samples finish with it.
    `params` are the user's (n, best_of, logprobs as asked); each sample runs with
    `params.for_sample(i)`.
    """

    request_id: str
    params: SamplingParams
    samples: list[Request] = field(default_factory=list)
    forked: bool = False

    @property
    def parent(self) -> Request:
        return self.samples[0]

    @property
    def size(self) -> int:
        return len(self.samples)


def sample_id(request_id: str, index: int) -> str:
    """The request id of sample `index` of a parallel-sampling request (0: the user's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def make_sample_group(request: Request) -> Optional[SampleGroup]:
    """Turn a request whose params ask for several samples into its group's parent (its params
    become sample 0's) and make the other samples; None (nothing changed) for one sample."""
    params = request.sampling_params
    if params.num_samples == 1:
        return None
    group = SampleGroup(request.request_id, params)
    for i in range(params.num_samples):
        sample = request if i == 0 else Request(
            request_id=sample_id(request.request_id, i),
            prompt_token_ids=request.prompt_token_ids, sampling_params=params,
            max_tokens=request.max_tokens, arrival_time=request.arrival_time,
            priority=request.priority, eos_token_ids=request.eos_token_ids,
            ttft_slo_ms=request.ttft_slo_ms, deadline=request.deadline,
            tpot_slo_ms=request.tpot_slo_ms)
        sample.sampling_params = params.for_sample(i)
        sample.group, sample.sample_index = group, i
        group.samples.append(sample)
    return group
