"""Requests as the scheduler sees them: token counts, status, sampling parameters.

No torch here: the scheduler, the KV cache manager and the simulator all share these objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence


class RequestStatus(enum.IntEnum):
    """Ordered: every status greater than PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> Optional[str]:
        """vLLM's names: 'stop', 'length', 'abort'; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls, named as vLLM names them.

    `temperature == 0` means greedy. `seed` makes random sampling reproducible per request
    whatever else shares the batch. `logprobs=n` returns the top-n log-probabilities of every
    sampled token (plus the sampled one's).
    """

    n: int = 1
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field; called on construction."""
        if self.n != 1:
            raise ValueError(f"n must be 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    max_computed_tokens: int = 0  # high-water mark of num_computed_tokens (survives preemption)
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    stop_reason: Optional[int | str] = None
    # TTFT target: `ttft_slo_ms` after arrival, or an absolute `deadline` (engine clock); the
    # explicit deadline wins. Read by the "slo" scheduling policy (core/sched/slo.py).
    ttft_slo_ms: Optional[float] = None
    deadline: Optional[float] = None
    num_slo_preemptions: int = 0  # times paused or cut for a more urgent request
    # Timestamps the engine fills in (seconds, engine clock); policy reads them, never time.time().
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

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
