"""The deadline-aware (slo) policy: EDF waiting order, the between-steps preempt gate, holds,
isolation of a prefill at risk, and the snapshot a monitor thread reads to cut a step.

The arithmetic (predictor, slack, EDF key, gate) is pure and lives in core/sched/slo.py; this
class turns the scheduler's requests into the gate's inputs and keeps the policy's state:
- holds: victim id -> the urgent request it gave way to. The victim gets no tokens (running) and
  is not admitted (waiting) until that request has its first token, so that its re-prefill
  never shares (and lengthens) the urgent request's prefill steps.
- `slo_snapshot`: the latest StepSnapshot, replaced whole after each step is planned, never
  mutated, so a monitor thread may read it without a lock.
- `ttft_predictor` and `step_latency_model`: given by the engine or the simulator after
  construction (measured, profiled or fitted); `step_latency_model`
  (`predict(SchedulerOutput, context_lens) -> seconds`) says how long the step in flight
  takes; without it the TTFT line is used, which ignores the context a chunk attends to.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.outputs import (PrefillView, SchedulerOutput, StepSnapshot, WaiterView)
from tokenweir.core.sched import slo
from tokenweir.core.sched.policies.base import Pause, SchedulingPolicy
from tokenweir.core.sched.policy import PreemptionCosts, is_prefilling
from tokenweir.core.sched.queues import DeadlineQueue, RequestQueue
from tokenweir.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler
    from tokenweir.core.sched.step_plan import StepPlan


class SLOPolicy(SchedulingPolicy):
    name = "slo"
    default_victim_policy = "fcfs"
    deadline_aware = True
    SNAPSHOT_WAITERS = 8  # the gate reads the head of the EDF order; a few suffice
    MIN_PREFILL_CHUNK = 64  # tokens a step's prefill may always take, TPOT targets or not

    def __init__(self, config: SchedulerConfig, costs: PreemptionCosts) -> None:
        super().__init__(config, costs)
        self.ttft_predictor = slo.TTFTPredictor(
            a=(config.slo_ttft_a_ms_per_token / 1000 if config.slo_ttft_a_ms_per_token is not None
               else costs.prefill_seconds_per_token),
            c=(config.slo_ttft_c_ms or 0.0) / 1000, b=config.slo_ttft_b_us_per_token2 / 1e6)
        self.slo_snapshot: Optional[StepSnapshot] = None
        self.step_latency_model = None
        self._holds: dict[str, str] = {}
        self._pause: Optional[Pause] = None  # this step's

    def make_waiting_queue(self) -> RequestQueue:
        return DeadlineQueue()

    # ---- the hooks ---------------------------------------------------------------------
    def begin_step(self, sched: "Scheduler", plan: "StepPlan") -> Optional[Pause]:
        self._pause = None
        plan.paused |= self._active_holds(sched.requests)
        self._order(sched, plan.now, plan.paused)
        pause = self._between_steps(sched, plan)
        self._guard_tpot(sched, plan)
        return pause

    def on_scheduled(self, sched: "Scheduler", request: Request, plan: "StepPlan") -> None:
        """A prefill at risk runs with decodes only: another prefill's chunk in the same step
        would add its cost, attention over its whole context included, to the time the deadline
        waits on. At risk: a deadline, and less slack than the larger of its own predicted TTFT
        and one full token budget's prefill (what a co-scheduled chunk can cost)."""
        deadline = _ttft_deadline(request)
        if deadline is None or not self.config.slo_isolate_at_risk_prefill:
            return
        predicted = self.predicted_ttft(sched, request)
        one_budget = self.ttft_predictor.predict(self.config.max_num_batched_tokens)
        if slo.slack(deadline, plan.now, predicted) < max(predicted, one_budget):
            plan.prefills_closed = True

    def victim_to_free(self, sched: "Scheduler", plan: "StepPlan") -> Optional[Request]:
        """The pause was not enough when the waiter still waits with budget and seats left:
        blocks are the problem, so this step's victim is preempted (its blocks freed,
        re-queued, still held back) and admission is tried again."""
        pause, self._pause = self._pause, None
        if pause is None:
            return None
        waiter = sched.requests.get(pause.waiter_id)
        if waiter is None or waiter.status == RequestStatus.RUNNING or plan.token_budget <= 0:
            return None
        if 0 < sched.config.max_num_seqs <= len(sched.running):  # the seats of this step
            return None
        victim = sched.requests.get(pause.victim_id)
        if victim is None or victim.status != RequestStatus.RUNNING:
            return None
        return victim

    def end_step(self, sched: "Scheduler", output: SchedulerOutput, now: float) -> None:
        counts = output.num_scheduled_tokens
        prefills = tuple(self._prefill_view(sched, r, pause=False) for r in sched.running
                         if counts.get(r.request_id, 0) > 1)
        self.slo_snapshot = StepSnapshot(output.step_id, now,
                                         self._predict_step_seconds(sched, output), prefills,
                                         self._waiter_views(sched))

    def on_cut(self, victim_id: str, waiter_id: Optional[str]) -> None:
        if waiter_id is not None:
            self._holds[victim_id] = waiter_id

    def slo_decide(self, prefills, waiters, now: float, wait_seconds: float,
                   pause: bool = False) -> tuple[slo.GateDecision, Optional[str]]:
        """The configured gate for a cut (the SLO monitor thread calls it: reads config only)
        or, with `pause`, for a pause between steps; `prefills` carry the count that the
        matching cap (`_cap`) applies to."""
        c = self.config
        return slo.evaluate(waiters, prefills, now, self.ttft_predictor, wait_seconds,
                            c.slo_preempt_gate, c.slo_margin_ms / 1000, self._cap(pause),
                            c.slo_hopeless_tolerance)

    def _cap(self, pause: bool) -> int:
        """Preemptions that make a request immune: with a separate pause cap, pauses count
        against it and cuts against slo_max_preemptions; without, both count together."""
        if pause and self.config.slo_max_pauses is not None:
            return self.config.slo_max_pauses
        return self.config.slo_max_preemptions

    # ---- predictions -------------------------------------------------------------------
    def predicted_ttft(self, sched: "Scheduler", request: Request) -> float:
        done = _done_tokens(sched, request)
        return self.ttft_predictor.predict(request.num_tokens - done, computed_tokens=done)

    def _edf_key(self, sched: "Scheduler", request: Request, now: float) -> float:
        deadline = _ttft_deadline(request)
        predicted = self.predicted_ttft(sched, request)
        return slo.edf_key(slo.slack(deadline, now, predicted), deadline, now,
                           slo.hopeless_below(predicted, self.config.slo_hopeless_tolerance))

    def _predict_step_seconds(self, sched: "Scheduler", output: SchedulerOutput) -> float:
        counts = output.num_scheduled_tokens
        if not counts:
            return 0.0
        if self.step_latency_model is None:
            return self.ttft_predictor.predict(output.total_num_scheduled_tokens)
        context = {rid: sched.requests[rid].num_computed_tokens for rid in counts}
        return self.step_latency_model.predict(output, context)

    # ---- the step's token budget ---------------------------------------------------------
    def _guard_tpot(self, sched: "Scheduler", plan: "StepPlan") -> None:
        """Cap the step's budget so that its prefill chunk (running or admitted) keeps every
        running decode with a TPOT target on target: the step may take no longer than the
        smallest `slo.tpot_allowance`; a decode with slack to spare does not limit it. The
        prefill always gets at least MIN_PREFILL_CHUNK tokens, so prefills never starve.
        Without a TPOT target anywhere (no config default, no running request's own) nothing
        can limit the budget: it returns at once."""
        if self.config.slo_tpot_ms is None and \
                all(r.tpot_slo_ms is None for r in sched.running):
            return
        self._cap_budget_for_tpot(sched, plan)

    def _cap_budget_for_tpot(self, sched: "Scheduler", plan: "StepPlan") -> None:
        """_guard_tpot past its early return: the cap itself."""
        decodes = [r for r in sched.running
                   if not is_prefilling(r) and r.request_id not in plan.paused]
        allowance = min((self._tpot_allowance(r, plan.now) for r in decodes), default=math.inf)
        if allowance == math.inf:
            return
        context = next((r.num_computed_tokens for r in sched.running
                        if is_prefilling(r) and r.request_id not in plan.paused), 0)
        most = plan.token_budget - len(decodes)
        chunk = slo.prefill_tokens_within(self.ttft_predictor, allowance, context,
                                          len(decodes), most)
        chunk = max(chunk, min(self.MIN_PREFILL_CHUNK, most))
        plan.token_budget = min(plan.token_budget, len(decodes) + chunk)

    def _tpot_allowance(self, request: Request, now: float) -> float:
        """The time the step may take for `request`'s TPOT (inf: no limit)."""
        target_ms = (request.tpot_slo_ms if request.tpot_slo_ms is not None
                     else self.config.slo_tpot_ms)
        if target_ms is None or request.first_token_time is None:
            return math.inf
        return slo.tpot_allowance(target_ms / 1000, request.num_output_tokens,
                                  request.first_token_time, now)

    # ---- the step's order and the gate -------------------------------------------------
    def _active_holds(self, requests: dict[str, Request]) -> set[str]:
        """Victims still held back; a hold ends when its urgent request has its first token,
        is gone, or is itself held (so holds never form a cycle that nothing can break)."""
        for victim_id, waiter_id in list(self._holds.items()):
            waiter = requests.get(waiter_id)
            if waiter is None or waiter.first_token_time is not None or \
                    victim_id not in requests or waiter_id in self._holds:
                del self._holds[victim_id]
        return set(self._holds)

    def _order(self, sched: "Scheduler", now: float, held: set[str]) -> None:
        """Waiting queue in EDF order, held victims last; running decodes first (admission
        order), then running prefills most urgent first, so an admitted urgent request gets
        its chunks first."""
        sched.waiting.reorder(lambda r: -math.inf if r.request_id in held
                              else self._edf_key(sched, r, now))
        sched.running.sort(key=lambda r: (1, -self._edf_key(sched, r, now))
                           if is_prefilling(r) else (0, 0.0))

    def _between_steps(self, sched: "Scheduler", plan: "StepPlan") -> Optional[Pause]:
        """Pause the running prefill the gate names for this step, so the urgent waiter can be
        admitted in its place; the victim keeps its blocks and computed tokens."""
        prefills = [self._prefill_view(sched, r, pause=True) for r in sched.running
                    if is_prefilling(r) and r.request_id not in plan.paused]
        if not prefills or not sched.waiting:
            return None
        predictor = self.ttft_predictor  # the running prefills' backlog, without fixed costs
        backlog = sum(predictor.predict(p.owed_tokens, computed_tokens=p.computed_tokens)
                      - predictor.c for p in prefills)
        decision, waiter_id = self.slo_decide(prefills, self._waiter_views(sched), plan.now,
                                              backlog, pause=True)
        if not decision.fire:
            return None
        self._holds[decision.victim_id] = waiter_id
        self._pause = Pause(decision.victim_id, waiter_id)
        return self._pause

    def _prefill_view(self, sched: "Scheduler", request: Request, pause: bool) -> PrefillView:
        """The prefill as the gate for a pause (`pause`) or a cut sees it: its count is the
        one `_cap(pause)` caps."""
        count = request.num_slo_preemptions
        if self.config.slo_max_pauses is not None:
            count = request.num_slo_pauses if pause else count - request.num_slo_pauses
        return PrefillView(request.request_id, _ttft_deadline(request),
                           request.num_tokens - request.num_computed_tokens,
                           count, request.num_computed_tokens)

    def _waiter_views(self, sched: "Scheduler") -> tuple[WaiterView, ...]:
        views = []
        for request in sched.waiting:
            if len(views) == self.SNAPSHOT_WAITERS:
                break
            if request.request_id in self._holds:
                continue  # held back: it cannot be admitted, so it cannot be the urgent one
            done = _done_tokens(sched, request)
            views.append(WaiterView(request.request_id, _ttft_deadline(request),
                                    request.num_tokens - done, done))
        return tuple(views)


def _ttft_deadline(request: Request) -> Optional[float]:
    """The deadline that still matters: None once the first token came."""
    return None if request.first_token_time is not None else request.ttft_deadline


def _done_tokens(sched: "Scheduler", request: Request) -> int:
    """Tokens a TTFT prediction may count as done: the computed ones, or for a request waiting
    after a preemption the full blocks it left in the prefix cache (admission finds them again
    unless they were evicted meanwhile)."""
    done = request.num_computed_tokens
    if request.status != RequestStatus.RUNNING and sched.kv.enable_prefix_caching:
        block_size = sched.kv.block_size
        left = min(request.max_computed_tokens, request.num_tokens - 1)
        done = max(done, left // block_size * block_size)
    return done
