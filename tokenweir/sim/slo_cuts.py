"""The SLO monitor and the layer-boundary cut, modelled on the simulator's virtual clock.

The real engine's monitor thread looks at the step in flight when an arrival wakes it, when
a step it may cut (one with a prefill chunk) begins, and otherwise every POLL_SECONDS while
such a step runs (its timer restarts at each look; slack shrinks as time passes, so a poll
can fire where the arrival's look did not); through a decode-only step it sleeps. Here it
looks at the same moments: at each arrival during a step, at the start of a watched step
(`look_at_start`), and at the polls of that timer's chain that fall inside a watched step
(the simulator queues them as Poll events: `next_poll`, `poll`). It is the same SLOMonitor,
reading the same scheduler snapshot, writing the same CutOrder into the same CutSignal. The
runner's layer boundaries are evenly spaced over the step's forward pass: with the latency
model's `forward_phases` (sim/forward_phases.py: fitted from traces) the step is pre-forward
work, the forward, then sampling and the engine's update, and boundary k falls at
start + pre + k / L * forward; an order issued at time t is obeyed at the next boundary,
i = max(0, ceil((t - start - pre) / forward * L)), unless i is past the layer fraction, and the
cut step lasts pre + i / L * forward + the update's share (`ForwardPhases.cut_seconds`).
Without phases (a roofline, an older profile) the forward is the whole step (pre = post = 0):
i = ceil((t - start) / seconds * L), the cut step i / L of its time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.slo import TTFTPredictor
from tokenweir.engine.slo_monitor import POLL_SECONDS, SLOMonitor, resolve_ttft_predictor
from tokenweir.request import Request
from tokenweir.runner.interrupt import CutSignal
from tokenweir.sim.forward_phases import ForwardPhases
from tokenweir.sim.sim_runner import SimRunner

DEFAULT_NUM_LAYERS = 32


class SimStepCutter:
    def __init__(self, scheduler, runner: SimRunner, num_layers: int,
                 layer_fraction: float, phases: Optional[ForwardPhases] = None) -> None:
        self.runner = runner
        self.num_layers = num_layers
        self.phases = phases  # None: the layers span the whole step
        self._split = (0.0, 0.0, 0.0)  # the ordered step's (pre, forward, post) seconds
        self.signal = CutSignal(num_layers, layer_fraction)
        self.arrived: list[Request] = []  # arrivals since the step in flight was scheduled
        self.monitor = SLOMonitor(scheduler.policy, self.signal, lambda: self.arrived)
        self._step: Optional[tuple[float, float, SchedulerOutput]] = None
        self._watched = False  # the step in flight is one the monitor polls
        self.poll_seconds = POLL_SECONDS
        self.last_look = 0.0  # when the monitor last looked (its timer runs from there)
        self.chain = 0  # bumped when a look restarts the timer (an arrival, a watched step's
        # start): older polls are stale
        runner.keep_undo = True

    def step_started(self, start: float, seconds: float, out: SchedulerOutput) -> None:
        self._step = (start, seconds, out)
        self.arrived = []
        self._watched = self.monitor.watching()

    def look_at_start(self, now: float) -> Optional[tuple[float, ModelRunnerOutput]]:
        """The engine wakes the monitor as a step it may cut begins (`step_scheduled`): its
        look at `now`, the timer restarted there; returns a cut as `on_arrival` does. None
        at once for a step it does not watch."""
        if not self._watched:
            return None
        self.chain += 1
        return self.look(now)

    def step_ended(self) -> None:
        """The step in flight completed (a look from now on finds none until the next)."""
        self._step = None

    def next_poll(self, now: float) -> Optional[float]:
        """The monitor's first timer look after `now` (its timer ticks every poll_seconds
        from its last look), if the step in flight is watched and the look falls before it
        ends; else None."""
        if self._step is None or not self._watched:
            return None
        start, seconds, _ = self._step
        ticks = max(1, math.floor((now - self.last_look) / self.poll_seconds) + 1)
        at = self.last_look + ticks * self.poll_seconds
        return at if at < start + seconds else None

    def on_arrival(self, request: Request, now: float
                   ) -> Optional[tuple[float, ModelRunnerOutput]]:
        """Called for each arrival (it wakes the monitor, which restarts its timer; with no
        step in flight that is all). Returns (the time the step ends, cut, and the cut runner
        output) when the monitor orders the step in flight cut."""
        self.arrived.append(request)
        self.chain += 1
        return self.look(now)

    def look(self, now: float) -> Optional[tuple[float, ModelRunnerOutput]]:
        """The monitor looks at the step in flight at `now` (an arrival's wake or a timer
        poll); returns the cut as `on_arrival` does."""
        self.last_look = now
        if self._step is None:
            return None
        start, seconds, out = self._step
        order = self.monitor.check_once(now)
        if order is None or order.step_id != out.step_id or seconds <= 0:
            return None
        self._split = (self.phases.split(seconds, sampled_rows(out)) if self.phases
                       else (0.0, seconds, 0.0))
        layer = boundary_after(now - start, self._split, self.num_layers)
        if self.signal.order_for(out.step_id, layer) is None:
            return None  # past the layer fraction: the step refuses the cut
        self._step = None
        cut = self.cut_step(out, seconds, layer, order)
        return start + cut.step_seconds, cut

    def cut_step(self, out: SchedulerOutput, seconds: float, layer: int,
                 order) -> ModelRunnerOutput:
        """The runner's cut of the step in flight (`seconds` long uncut) before `layer`, its
        length the cut's share of the step (see the module doc)."""
        cut = self.runner.cut(out, seconds, layer, self.num_layers, order.victim_id,
                              order.waiter_id)
        if self.phases is None:
            return cut
        return dataclasses.replace(cut, step_seconds=self.phases.cut_seconds(
            self._split, layer, self.num_layers))


def boundary_after(elapsed: float, split: tuple[float, float, float], num_layers: int) -> int:
    """The first layer boundary at or after `elapsed` seconds into a step whose (pre, forward,
    post) seconds are `split`: boundary k lies at pre + k / num_layers * forward (the layer
    hook runs before layer k); num_layers once the forward is over."""
    pre, forward, _ = split
    if forward <= 0:
        return num_layers
    return min(num_layers, max(0, math.ceil((elapsed - pre) / forward * num_layers)))


def sampled_rows(out: SchedulerOutput) -> int:
    """The rows of a step that sample (the runner's `sample_req_ids`): those whose tokens this
    step reach the end of their known tokens (read before the step's update)."""
    requests = out.scheduled_requests
    if requests is None:
        return 0
    counts = out.num_scheduled_tokens
    return sum(1 for r in requests
               if r.num_computed_tokens + counts[r.request_id] >= r.num_tokens)


def solo_ttft(latency_model, prompt_len: int, budget: int) -> float:
    """Seconds from admission to first token of a request alone on the instance: its prompt
    in budget-sized chunks, each chunk one step on the latency model."""
    seconds, done = 0.0, 0
    while done < prompt_len:
        n = min(budget, prompt_len - done)
        seconds += latency_model.step_time([(n, done)])
        done += n
    return seconds


def fit_ttft(latency_model, budget: int, longest: int, quadratic: bool = True,
             num_points: int = 16) -> tuple[TTFTPredictor, float]:
    """The TTFT predictor fitted to the solo TTFTs of prompts evenly spread over
    [longest / num_points, longest] by least squares on RELATIVE error (weights 1/ttft^2, so
    short prompts count as much as long ones), and its R^2. quadratic: a * n + b * n^2 + c
    (attention makes the true curve convex); else the plain line a * n + c."""
    xs = [longest * (i + 1) // num_points for i in range(num_points)]
    ys = [solo_ttft(latency_model, x, budget) for x in xs]
    rows = [[float(x), float(x * x), 1.0] if quadratic else [float(x), 1.0] for x in xs]
    coef = _weighted_least_squares(rows, ys, [1.0 / (y * y) for y in ys])
    predictor = (TTFTPredictor(a=coef[0], b=coef[1], c=coef[2]) if quadratic
                 else TTFTPredictor(a=coef[0], c=coef[1]))
    mean = sum(ys) / len(ys)
    residual = sum((y - predictor.predict(x)) ** 2 for x, y in zip(xs, ys))
    return predictor, 1.0 - residual / sum((y - mean) ** 2 for y in ys)


def _weighted_least_squares(rows: list[list[float]], ys: list[float],
                            ws: list[float]) -> list[float]:
    """Solve the normal equations (X^T W X) beta = X^T W y by Gaussian elimination."""
    k = len(rows[0])
    m = [[sum(w * r[i] * r[j] for r, w in zip(rows, ws)) for j in range(k)]
         + [sum(w * r[i] * y for r, w, y in zip(rows, ws, ys))] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


def setup_slo(config, scheduler, runner: SimRunner, latency_model, max_model_len: int,
              quadratic: bool = True) -> Optional[SimStepCutter]:
    """A deadline-aware policy (slo, or a user's that says so): the TTFT predictor (explicit
    coefficients or profile, else fitted to the latency model: quadratic unless told
    otherwise), the step-time model (unless slo_step_predictor says to predict steps by the
    TTFT line, as the real engine does), and, with mid-step cuts on, the cutter; else None."""
    sched, policy = config.scheduler, scheduler.policy
    if not policy.deadline_aware:
        return None
    if sched.slo_step_predictor == "auto":  # the step in flight: as long as it will be
        policy.step_latency_model = latency_model
    explicit = sched.slo_ttft_profile or (sched.slo_ttft_a_ms_per_token is not None
                                          and sched.slo_ttft_c_ms is not None)
    if hasattr(latency_model, "step_time") and not explicit:
        policy.ttft_predictor = fit_ttft(latency_model, sched.max_num_batched_tokens,
                                            max_model_len, quadratic)[0]
    elif explicit:
        policy.ttft_predictor = resolve_ttft_predictor(sched, lambda: (0.0, 0.0))
    if not sched.slo_mid_step_cut:
        return None
    return SimStepCutter(scheduler, runner, model_num_layers(latency_model),
                         sched.slo_cut_layer_fraction, ForwardPhases.of(latency_model))


def model_num_layers(latency_model) -> int:
    """The layers of the modelled model (a roofline's shape, a profile's `num_layers`), else
    DEFAULT_NUM_LAYERS."""
    shape = getattr(latency_model, "shape", None)
    if shape is not None:
        return shape.num_layers
    return getattr(latency_model, "num_layers", 0) or DEFAULT_NUM_LAYERS
