"""Deadline-aware (SLO) policy: pure functions, no state, no clocks, no torch.

Vocabulary (all times in seconds on the caller's clock; `now` is always an argument):

- A request's TTFT deadline is absolute (`Request.ttft_deadline`): an explicit deadline, or
  arrival + ttft_slo_ms. A request without one is infinitely patient (slack = +inf).
- `TTFTPredictor`: predicted_ttft = a * (uncached prompt tokens + tokens queued ahead)
  + b * (attention over the prompt still to prefill, which sees the tokens already computed) + c.
- slack = (deadline - now) - predicted_ttft. A request is hopeless when its slack is below
  -tolerance * predicted_ttft (`hopeless_below`): it would miss even running `tolerance`
  faster than predicted. tolerance 0 is the plain sign of the slack; a positive one keeps a
  near miss rescuable when the predictor's error (on a real machine, +-10%) is as large as the
  deadline's headroom, instead of sinking it behind every request that has time to spare.
  The same tolerance makes the gate's "it can wait its turn" pessimistic: only if it would
  still make it running `tolerance` slower than predicted.
- EDF waiting order: descending sign(slack) / |deadline - now|, i.e. rescuable requests first,
  most urgent (nearest deadline) first; no-deadline requests next; hopeless ones sink.
- The preempt gate compares the best waiter with the running prefills that could be paused
  or cut (the candidates), with the four slack-sign cases handled explicitly (see `gate`).
- Stubbornness: a request already SLO-preempted `max_slo_preemptions` times is immune, and a
  forward pass past `layer_fraction` of its layers refuses to be cut (`may_cut_at_layer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from tokenweir.core.outputs import PrefillView, StepSnapshot, WaiterView  # noqa: F401

CONSERVATIVE, AGGRESSIVE = "conservative", "aggressive"
SLO_GATES = (CONSERVATIVE, AGGRESSIVE)

# Gate outcomes (`GateDecision.case`): why the gate fired or held.
NO_WAITER = "no-waiter"
NO_CANDIDATE = "no-candidate"
ALL_IMMUNE = "all-immune"
NO_NEED = "waiter-meets-deadline-by-waiting"
BOTH_HOPELESS = "both-hopeless"
WAITER_HOPELESS = "waiter-hopeless"
RUNNING_HOPELESS = "running-hopeless-yields"
MARGIN_BEATEN = "margin-beaten"
MARGIN_NOT_BEATEN = "margin-not-beaten"
VICTIM_WOULD_MISS = "victim-would-miss"

_EPSILON = 1e-9  # seconds: keeps sign(slack) / |deadline - now| finite at the deadline


@dataclass(frozen=True, slots=True)
class TTFTPredictor:
    """predicted_ttft = a * tokens + c, with `a` seconds per uncached prompt token and `c`
    seconds of fixed cost (fitted by `tokenweir calibrate`, measured at start-up, or given).

    Optional `b` adds the attention term: a long prompt's TTFT is convex in its length (each
    chunk attends to everything before it), which a line cannot follow over a wide range of
    lengths. Fitted to solo TTFTs it is b * n^2 for a prompt of n tokens; the last n tokens of
    a prompt whose first `computed_tokens` are already in the cache pay
    b * ((computed + n)^2 - computed^2), which is what their chunks attend to. (The simulator
    fits b; 0 keeps the plain line.)"""

    a: float
    c: float
    b: float = 0.0

    def predict(self, uncached_tokens: int, tokens_ahead: int = 0,
                computed_tokens: int = 0) -> float:
        """TTFT of a request that still has `uncached_tokens` to prefill on top of
        `computed_tokens` already computed, behind `tokens_ahead` tokens of work that will run
        before it."""
        total = computed_tokens + uncached_tokens
        return (self.a * (uncached_tokens + tokens_ahead)
                + self.b * (total * total - computed_tokens * computed_tokens) + self.c)


def slack(deadline: Optional[float], now: float, predicted_ttft: float) -> float:
    """(deadline - now) - predicted_ttft; +inf without a deadline."""
    if deadline is None:
        return math.inf
    return (deadline - now) - predicted_ttft


def hopeless_below(predicted_ttft: float, tolerance: float) -> float:
    """The slack under which a request is hopeless: -tolerance * predicted_ttft."""
    return -tolerance * predicted_ttft


def edf_key(request_slack: float, deadline: Optional[float], now: float,
            hopeless_below: float = 0.0) -> float:
    """Larger = admit first: sign / |deadline - now|, the sign -1 for a hopeless request
    (slack < hopeless_below). No deadline -> 0 (after every rescuable request, before every
    hopeless one)."""
    if deadline is None:
        return 0.0
    sign = 1.0 if request_slack >= hopeless_below else -1.0
    return sign / max(abs(deadline - now), _EPSILON)


def infeasible_alone(predictor: TTFTPredictor, prompt_tokens: int, ttft_target: float,
                     tolerance: float = 0.0) -> bool:
    """The request would miss its TTFT target even alone on the instance: hopeless (see
    `hopeless_below`) the moment it arrives, whatever the load."""
    predicted = predictor.predict(prompt_tokens)
    return ttft_target - predicted < hopeless_below(predicted, tolerance)


# ---- TPOT: the time a decode may wait for its next token -----------------------------------
def tpot_allowance(tpot_target: float, num_output_tokens: int, first_token_time: float,
                   now: float) -> float:
    """Seconds the next step may take with the request's mean time per output token (after
    the first) still within `tpot_target` when that step's token arrives: after it the request
    has num_output_tokens + 1 tokens, num_output_tokens gaps since its first token, so
    step <= tpot_target * num_output_tokens - (now - first_token_time). Holding this at every
    step keeps the mean on target whatever the output's final length. Negative: already late."""
    return tpot_target * num_output_tokens - (now - first_token_time)


def prefill_tokens_within(predictor: TTFTPredictor, seconds: float, context: int,
                          num_decodes: int, most: int) -> int:
    """The longest prefill chunk (<= `most` tokens) of a prompt with `context` tokens already
    computed that, with `num_decodes` decode tokens beside it, the predictor says runs within
    `seconds` (a, b and c of one step); 0 when not even one token does."""
    def step_seconds(n: int) -> float:
        return predictor.predict(n, tokens_ahead=num_decodes, computed_tokens=context)

    if most <= 0 or step_seconds(1) > seconds:
        return 0
    lo, hi = 1, most  # step_seconds(lo) <= seconds; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_seconds(mid) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Candidate:
    """A running prefill the gate may pause or cut, as the gate sees it."""

    request_id: str
    slack: float  # if it keeps running
    num_slo_preemptions: int = 0
    hopeless_below: float = 0.0  # hopeless when slack < this


@dataclass(frozen=True, slots=True)
class Waiter:
    """The best waiting request: its slack if served now and if it waits its turn."""

    request_id: str
    slack_if_served_now: float
    slack_if_it_waits: float
    hopeless_below: float = 0.0  # hopeless when slack_if_served_now < this
    service_seconds: float = 0.0  # predicted TTFT if served now: what a victim waits for it
    can_wait_above: float = 0.0  # it can wait its turn when slack_if_it_waits >= this


@dataclass(frozen=True, slots=True)
class GateDecision:
    fire: bool
    case: str
    victim_id: Optional[str] = None


def is_immune(num_slo_preemptions: int, max_slo_preemptions: int) -> bool:
    """Stubbornness rule 1: a request SLO-preempted this often may not be preempted again."""
    return num_slo_preemptions >= max_slo_preemptions


def may_cut_at_layer(layer_index: int, num_layers: int, layer_fraction: float) -> bool:
    """Stubbornness rule 2: a forward pass that has run `layer_fraction` of its layers (the
    layers before `layer_index`) refuses to be cut: finishing costs less than redoing."""
    return layer_index < layer_fraction * num_layers


def gate(waiter: Optional[Waiter], candidates: Sequence[Candidate], mode: str,
         margin: float, max_slo_preemptions: int) -> GateDecision:
    """Should `waiter` take the place of a running prefill? Returns the victim when it should.

    Preconditions checked first: a waiter, a non-immune candidate, and a waiter that would
    miss its deadline by waiting (otherwise preempting buys nothing; with a tolerance, "would
    miss" includes running that fraction slower than predicted: `can_wait_above`). Then the
    reference is the MOST urgent candidate (conservative) or the LEAST urgent one (aggressive), and:
      waiter hopeless and reference hopeless -> never (BOTH_HOPELESS)
      waiter hopeless                        -> never (WAITER_HOPELESS)
      reference hopeless                     -> yield: the reference is the victim
      both rescuable                         -> fire iff waiter slack + margin < reference
                                                slack, and the victim (the least urgent
                                                candidate) stays rescuable after waiting the
                                                waiter's service time: trading one miss for
                                                another buys nothing and wastes the cut work.
    "Hopeless" is slack < hopeless_below (0 unless a tolerance is set); the waiter's slack
    is its slack if served now.
    """
    if waiter is None:
        return GateDecision(False, NO_WAITER)
    if not candidates:
        return GateDecision(False, NO_CANDIDATE)
    eligible = [c for c in candidates if not is_immune(c.num_slo_preemptions, max_slo_preemptions)]
    if not eligible:
        return GateDecision(False, ALL_IMMUNE)
    if waiter.slack_if_it_waits >= waiter.can_wait_above:
        return GateDecision(False, NO_NEED)
    if mode == CONSERVATIVE:
        reference = min(eligible, key=lambda c: c.slack)
    elif mode == AGGRESSIVE:
        reference = max(eligible, key=lambda c: c.slack)
    else:
        raise ValueError(f"unknown SLO gate {mode!r}; known: {SLO_GATES}")
    waiter_hopeless = waiter.slack_if_served_now < waiter.hopeless_below
    running_hopeless = reference.slack < reference.hopeless_below
    if waiter_hopeless and running_hopeless:
        return GateDecision(False, BOTH_HOPELESS)
    if waiter_hopeless:
        return GateDecision(False, WAITER_HOPELESS)
    if running_hopeless:
        return GateDecision(True, RUNNING_HOPELESS, reference.request_id)
    if waiter.slack_if_served_now + margin >= reference.slack:
        return GateDecision(False, MARGIN_NOT_BEATEN)
    victim = max(eligible, key=lambda c: c.slack)
    if victim.slack - waiter.service_seconds < victim.hopeless_below:
        return GateDecision(False, VICTIM_WOULD_MISS)
    return GateDecision(True, MARGIN_BEATEN, victim.request_id)


def met_deadline(first_token_time: Optional[float], deadline: Optional[float]) -> Optional[bool]:
    """Whether a first token came by the deadline; None for a request without one."""
    if deadline is None:
        return None
    return first_token_time is not None and first_token_time <= deadline


# ---- from requests to the gate's inputs ------------------------------------------------------
# PrefillView, WaiterView and StepSnapshot cross the scheduler boundary (a monitor thread reads
# them), so they live in core/outputs.py; imported here for the gate's callers.


def evaluate(waiters: Sequence[WaiterView], prefills: Sequence[PrefillView], now: float,
             predictor: TTFTPredictor, wait_seconds: float, mode: str, margin: float,
             max_slo_preemptions: int,
             tolerance: float = 0.0) -> tuple[GateDecision, Optional[str]]:
    """Run the gate for the most urgent waiter with a deadline. Served now, its TTFT is
    predict(its own tokens); if the gate holds it first waits `wait_seconds` (between steps:
    the running prefills' backlog; inside a step: the rest of the step, after which the
    between-steps pause can still admit it). `tolerance` sets who is hopeless (see the module
    docstring). Returns the decision and the waiter's id."""
    best = most_urgent_waiter(waiters, now, predictor, tolerance)
    if best is None:
        return gate(None, (), mode, margin, max_slo_preemptions), None
    served_now = predictor.predict(best.owed_tokens, computed_tokens=best.computed_tokens)
    if_waits = wait_seconds + served_now
    waiter = Waiter(best.request_id, slack(best.deadline, now, served_now),
                    slack(best.deadline, now, if_waits), hopeless_below(served_now, tolerance),
                    served_now, can_wait_above=tolerance * if_waits)
    candidates = []
    for p in prefills:
        predicted = predictor.predict(p.owed_tokens, computed_tokens=p.computed_tokens)
        candidates.append(Candidate(p.request_id, slack(p.deadline, now, predicted),
                                    p.num_slo_preemptions, hopeless_below(predicted, tolerance)))
    return gate(waiter, candidates, mode, margin, max_slo_preemptions), best.request_id


def most_urgent_waiter(waiters: Sequence[WaiterView], now: float, predictor: TTFTPredictor,
                       tolerance: float = 0.0) -> Optional[WaiterView]:
    """The waiter with a deadline that EDF puts first (largest key), or None."""
    best, best_key = None, -math.inf
    for w in waiters:
        if w.deadline is None:
            continue
        predicted = predictor.predict(w.owed_tokens, computed_tokens=w.computed_tokens)
        key = edf_key(slack(w.deadline, now, predicted), w.deadline, now,
                      hopeless_below(predicted, tolerance))
        if key > best_key:
            best, best_key = w, key
    return best
