"""The simulator's side of a decode stretch (core/sched/decode_stretch.py): an instance whose
steps are provably pure decode of the same running set runs them touching only the requests
with an event in each step (a block boundary, a block filled, a finish), each step still one
event of the simulator's loop at the time the general path would end it.

Per step, what the general path does and the stretch does instead:
  SimRunner.execute: the finished ids are forgotten; the step time is the latency model's
    `predict_totals` of the same StepTotals (n decode rows, context = the sum of their computed
    tokens, kept incrementally as integers); each row's regular samples left (`_left`) are
    caught up when the row finishes or the stretch ends (`advance_decoding`).
  SimEngine records: one gap value (this step's end minus the previous one's: every row's
    previous token came then) counted n times (or appended n times in order); finishes as
    `_finished`; `_last_token` caught up at the end.
A step that schedules more than the rows (the tail, requests admitted: the scheduler's real
passes, beside the rows) hands their output to `SimRunner.execute_beside`, which samples and
times them as `execute` would within the whole step (the rows' sums added), and, when the step
ends, to `complete_step` after the rows' update (the step's order: rows first); from the front
of the tail, each request that came out a decode on the runner's fast path joins the stretch
(`DecodeStretch.join`) until one did not.
Only on an instance where the runner's decoding fast path applies, with no pipeline, no SLO
cutter, no gap end times, no checks, mixed role, and a policy without per-step hooks
(`stands`). The stretch starts where the leading running requests are decodes on the runner's
fast path whose last token came at the end of the step just completed (`now`): they are its
rows. It ends (`leave`) before any step it cannot prove: the instance then takes the general
path.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Optional

from tokenweir.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.decode_stretch import (DecodeStretch, eligible_rows, is_plain_decode,
                                                 policy_allows)
from tokenweir.sim.latency import StepTotals, decode_predictor

if TYPE_CHECKING:
    from tokenweir.sim.instance import Instance


def stands(inst: "Instance") -> bool:
    """The standing conditions for stretches on `inst` (see the module docstring)."""
    return (inst.pp_size == 1 and inst.cutter is None and inst.role == "mixed"
            and not inst.check and inst.itl_times is None and inst.runner.fast_path_possible()
            and policy_allows(inst.scheduler.policy))


class StretchDriver:
    def __init__(self, inst: "Instance") -> None:
        runner = inst.runner
        self.inst, self.runner = inst, runner
        self.core = DecodeStretch(inst.scheduler, runner.regular_token_ids,
                                  runner.eos_token_id,
                                  runner.regular_block_rule(inst.kv.block_size))
        model = runner.latency_model
        self._predict = model.predict_totals
        self._predict_decodes = decode_predictor(model)  # None: through predict_totals
        self._prev_end = 0.0
        # the step in flight's output of the tail and admitted requests and the runner's, or None
        self._beside: Optional[tuple[SchedulerOutput, ModelRunnerOutput]] = None
        itl = inst.itl if inst.record_itl else None
        # a step's gaps: n equal values appended in order, or counted (None: not kept)
        self._gaps_in_order = itl if isinstance(itl, array) else None
        self._gap_counts = None if itl is None or isinstance(itl, array) else itl

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def start(self, now: float) -> Optional[float]:
        """Plan and time the next step as a stretch step; its seconds, or None (the instance
        takes the general path: any stretch was left)."""
        core = self.core
        if core.active and not core.can_continue():
            self._leave()
        if not core.active and not self._enter(now):
            return None
        finished, beside = core.plan_step(now)
        n, context = core.n, core.context
        if beside is None:
            self._beside = None
            if finished:
                self.runner.forget(finished)
            if self._predict_decodes is not None:
                return self._predict_decodes(n, context)
            return self._predict(StepTotals(n, n, n, context, context, n, context))
        runner_out = self.runner.execute_beside(beside, n, context)
        self._beside = (beside, runner_out)
        return runner_out.step_seconds

    def step_shape(self) -> tuple[int, int, int]:
        """The step in flight's (requests, requests computing one token, tokens)."""
        n = self.core.n
        if self._beside is None:
            return n, n, n
        out = self._beside[0]
        counts = out.num_scheduled_tokens
        return (n + len(counts), n + list(counts.values()).count(1),
                n + out.total_num_scheduled_tokens)

    def _enter(self, now: float) -> bool:
        """Start a stretch over the leading running requests that may be rows: on the
        runner's fast path, their last token at `now` (False: none, no stretch)."""
        inst = self.inst
        left_of, last_token = self.runner.decoding_left, inst._last_token
        rows, eos_steps = [], []
        for r in eligible_rows(inst.scheduler):
            rid = r.request_id
            left = left_of(rid)
            if left is None or last_token.get(rid) != now:
                break
            rows.append(r)
            eos_steps.append(left if left > 0 else 0)
        if not rows:
            return False
        self.core.enter(rows, eos_steps)
        self._prev_end = now
        if self.core.can_continue():
            return True
        self.core.leave()  # no step taken: nothing to catch up
        return False

    def complete(self, now: float) -> list[EngineCoreOutput]:
        """The stretch step in flight ends at `now`: the rows' update and records, then the
        tail's and the admitted requests' (which join the rows where they can); returns the
        outputs of the rows that took the stop rules (every finish among them), then
        theirs."""
        core, inst = self.core, self.inst
        n = core.n
        done = core.update_step(now)
        if self._gap_counts is not None:
            self._gap_counts.add(now - self._prev_end, n)
        elif self._gaps_in_order is not None:
            self._gaps_in_order.extend(array("d", (now - self._prev_end,)) * n)
        self._prev_end = now
        outputs = []
        for i, eco in done:
            outputs.append(eco)
            rid = eco.request.request_id
            inst._last_token[rid] = now
            if eco.finish_reason is not None:
                self.runner.advance_decoding(rid, core.steps_in(i))  # it decoded every one
                inst._finished(eco, now)
        if self._beside is not None:
            out, runner_out = self._beside
            self._beside = None
            outputs.extend(inst.complete_step(out, runner_out, now))
            self._join(now)
        return outputs

    def _join(self, now: float) -> None:
        """From the front of the tail, each request that is a plain decode on the runner's
        fast path with its last token at `now` joins the rows, until one is not."""
        core, running = self.core, self.inst.scheduler.running
        left_of, last_token = self.runner.decoding_left, self.inst._last_token
        while len(running) > core.n:
            r = running[core.n]
            left = left_of(r.request_id)
            if left is None or not is_plain_decode(r) or last_token.get(r.request_id) != now:
                return
            core.join(r, left)

    def _leave(self) -> None:
        kept = self.core.leave()
        advance = self.runner.advance_decoding
        for r, steps in kept:
            advance(r.request_id, steps)
        self.inst._last_token.update(dict.fromkeys([r.request_id for r, _ in kept],
                                                   self._prev_end))

    def leave_if_active(self) -> None:
        if self.core.active:
            self._leave()
