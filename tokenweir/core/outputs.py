"""Every object that crosses the scheduler's boundary.

To the runner and back: `SchedulerOutput` goes out each step; `ModelRunnerOutput` comes back.
To the engine: `EngineCoreOutput` per request per step, `SchedulerStats`, and the
`StepSnapshot` a deadline-aware policy publishes for a monitor thread (with its
`PrefillView` / `WaiterView` parts).

`SchedulerOutput` goes out each step; `ModelRunnerOutput` comes back. A runner (the real PyTorch
one or the simulator's) keeps its own per-request state keyed by request id:

- `scheduled_new_reqs` carry a request in full. A request re-admitted after preemption comes back
  here too (its runner state was dropped when it was preempted).
- `scheduled_cached_reqs` carry only what changed: blocks appended this step. (Stored as
  parallel lists and built on first read: a runner that never reads them, the simulator's,
  costs the scheduler nothing per running request.)
- `preempted_req_ids` and `finished_req_ids` (since the previous step) tell the runner what to
  forget. A request never appears both as scheduled and as finished in one output.

The runner samples a token for a request exactly when this step brings `num_computed_tokens`
up to the number of tokens the runner knows for it (prompt + outputs so far); a chunk that stops
short of that samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenweir.request import Request, SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (a copy: the runner may append to it)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # every block the request holds, in order
    num_computed_tokens: int  # tokens whose KV is already in those blocks (prefix-cache hit)


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]  # appended to the request's block table this step
    num_computed_tokens: int  # before this step's tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    num_scheduled_tokens: dict[str, int]  # every scheduled request -> tokens this step (>= 1)
    total_num_scheduled_tokens: int
    # The running (not new) requests scheduled this step, in order, with their computed tokens
    # before it; `new_block_ids` holds the blocks each scheduled request got this step (a
    # running request that got none may be absent). Together they are `scheduled_cached_reqs`.
    cached_req_ids: list[str] = field(default_factory=list)
    cached_num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    step_id: int = 0
    # Copies the runner makes BEFORE this step's forward, swap-ins first, then swap-outs:
    # (host block, device block) and (device block, host block) pairs.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write of forks' shared blocks (parallel sampling), device to device, (source,
    # destination) pairs, also before the forward: every source is read before the swaps and
    # every destination written after them (a destination may be a block a swap-out of this
    # step reads; a source, a block a swap-in of this step writes).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The scheduler's own: the Request of each entry of `num_scheduled_tokens`, in its order,
    # for its update (no lookup by id per request per step). Runners never read it; it is
    # not pickled (None in a tensor-parallel worker's copy), nor in an output built by hand.
    scheduled_requests: Optional[list[Request]] = field(default=None, repr=False, compare=False)
    _cached_reqs: Optional[list[CachedRequestData]] = None

    def __getstate__(self) -> tuple[None, dict]:
        state = {name: getattr(self, name) for name in self.__slots__}
        state["scheduled_requests"] = None
        return None, state

    @property
    def scheduled_cached_reqs(self) -> list[CachedRequestData]:
        """One CachedRequestData per running request scheduled this step (built once)."""
        if self._cached_reqs is None:
            new_block_ids = self.new_block_ids
            self._cached_reqs = [
                CachedRequestData(req_id, new_block_ids.get(req_id, []), num_computed)
                for req_id, num_computed in zip(self.cached_req_ids,
                                                self.cached_num_computed_tokens)]
        return self._cached_reqs

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be swaps to copy)."""
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position: the sampled token's and the top-n."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class CutReport:
    """A step cut short at an attention-layer boundary (runner/interrupt.py): layers
    0..layer_index-1 ran, none after; nothing was sampled."""

    step_id: int
    layer_index: int
    num_layers: int
    victim_id: str
    waiter_id: Optional[str] = None  # the urgent request the victim gives way to


@dataclass(slots=True)
class ModelRunnerOutput:
    # Request id -> tokens sampled this step (one, or none for a chunk short of the end).
    # The lists are read-only for every consumer: a runner may share one list between
    # requests and steps (the simulator's runner does: one per token id).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Seconds the step took on the runner's clock (wall clock, or virtual for the simulator).
    step_seconds: Optional[float] = None
    cut: Optional[CutReport] = None  # set when the step was cut: roll it back, do not update
    # Request id -> why handling it failed in the runner this step (its sampling raised). Such a
    # request has no entry in sampled_token_ids; the engine finishes it with an error before
    # the scheduler's update, which then skips it.
    request_errors: dict[str, str] = field(default_factory=dict)
    # Optional split of the runner's wall time (seconds): "prepare" (state updates, swaps,
    # batch building), "forward", "sample" (sampling and advancing its copies). Their sum is
    # at most `step_seconds`. Runners that do not split leave it None (the simulator's).
    phase_seconds: Optional[dict[str, float]] = None


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})


# ---- to the engine -------------------------------------------------------------------------
@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request (new tokens, and whether it finished)."""

    request: Request
    new_token_ids: list[int]
    logprobs: Optional[TokenLogprobs] = None
    finish_reason: Optional[str] = None


# Preemption causes: blocks ran out (MEMORY); a policy paused or freed a running prefill for a
# waiter between steps (SLO_BETWEEN_STEPS); a step was cut at a layer boundary (SLO_MID_STEP).
MEMORY, SLO_BETWEEN_STEPS, SLO_MID_STEP = "memory", "slo-between-steps", "slo-mid-step"
PREEMPTION_CAUSES = (MEMORY, SLO_BETWEEN_STEPS, SLO_MID_STEP)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefill_steps: int = 0  # prefill chunks that stopped short of the prompt's end
    prompt_tokens: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    generation_tokens: int = 0
    last_iteration_tokens: int = 0
    num_swapped_out: int = 0  # preemptions that swapped (requests)
    num_swapped_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    # Preemption events by cause (PREEMPTION_CAUSES). `num_preemptions` counts the requests
    # sent back to the waiting queue, whatever the cause.
    preemptions_by_cause: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(PREEMPTION_CAUSES, 0))
    slo_cut_steps: int = 0
    slo_wasted_layer_tokens: int = 0  # sum over cut steps of tokens x layers run, discarded
    slo_total_layer_tokens: int = 0  # sum over cut steps of tokens x all layers
    # TTFT attainment per request class (the request's priority, as a string): [met, missed]
    slo_attainment: dict[str, list[int]] = field(default_factory=dict)


# ---- to a monitor thread (deadline-aware policies) -------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefillView:
    """A running prefill as the gate needs it (immutable: safe to read from another thread)."""

    request_id: str
    deadline: Optional[float]  # None: no TTFT target, or its first token already came
    owed_tokens: int  # still to prefill (before the step in flight, for a snapshot)
    num_slo_preemptions: int  # the count its immunity cap applies to (pauses, cuts or both)
    computed_tokens: int = 0  # already in the cache (the owed tokens attend to them)


@dataclass(frozen=True, slots=True)
class WaiterView:
    request_id: str
    deadline: Optional[float]
    owed_tokens: int
    computed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepSnapshot:
    """What a deadline-aware policy publishes after planning step `step_id` (an atomic
    reference swap): the step's prefills (the cut candidates) and the waiting requests in EDF
    order."""

    step_id: int
    started_at: float
    predicted_seconds: float
    prefills: tuple[PrefillView, ...]
    waiters: tuple[WaiterView, ...]
