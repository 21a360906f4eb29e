"""The SLO monitor: a daemon thread that decides, while a step runs, whether to cut it.

It reads only immutable things: the deadline-aware policy's latest `StepSnapshot` (replaced
whole after each schedule(), an atomic reference read), the requests that arrived since (a copy
of the engine core's thread-safe inbox), and the policy's config and TTFT predictor. When the gate
fires for the step in flight it writes one `CutOrder` naming that step's id; the runner obeys at
its next attention-layer boundary (runner/interrupt.py). It never touches scheduler state:
the rollback happens on the engine thread, after the runner has unwound.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from tokenweir.core.sched import slo
from tokenweir.request import Request
from tokenweir.runner.interrupt import CutOrder, CutSignal

logger = logging.getLogger("tokenweir")


# How often the monitor looks at the step in flight when no arrival wakes it (the simulator's
# cutter polls on the same clock: sim/slo_cuts.py).
POLL_SECONDS = 0.02


class SLOMonitor:
    """Looks at the step in flight at once when `wake` is set, and otherwise every
    `poll_seconds` while that step is one it may cut (slack also shrinks as time passes).
    `wake` is set by the engine core on each submitted request (arrivals are what can make
    the gate fire mid-step) and by `step_scheduled` when a step with a prefill chunk begins.
    Through a step without one (decodes only: nothing to cut) the monitor sleeps until the
    next wake.

    Each look takes the GIL from the engine thread. Polling every 0.5 ms made CPU steps 10-20%
    slower, hence the slow poll: a layer boundary is milliseconds apart, a prefill chunk
    hundreds of them. Even at 20 ms, polls through decode-only steps made them ~0.8% slower
    (SmolLM2-135M float32, one thread, a lone decode at context 300, eight interleaved rounds:
    median step 15.19 ms polling against 15.07 sleeping, slower in every round; 15.11
    without the slo policy), hence the sleep."""

    def __init__(self, policy, signal: CutSignal, arrivals: Callable[[], Sequence[Request]],
                 clock: Callable[[], float] = time.monotonic, poll_seconds: float = POLL_SECONDS,
                 wake: Optional[threading.Event] = None) -> None:
        self.policy = policy  # a deadline-aware scheduling policy (policies/slo.py)
        self.signal = signal
        self.arrivals = arrivals  # requests submitted but not yet handed to the scheduler
        self.clock = clock
        self.poll_seconds = poll_seconds
        self.wake = wake if wake is not None else threading.Event()
        self.num_orders = 0
        self.num_checks = 0
        self._last_ordered_step = -1
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "SLOMonitor":
        self._thread = threading.Thread(target=self._run, name="tokenweir-slo-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def step_scheduled(self) -> None:
        """Engine thread, after each schedule() (the snapshot is published): when the step
        about to run is one the monitor may cut, wake it to look now and poll while it runs."""
        if self.watching():
            self.wake.set()

    def watching(self) -> bool:
        """Whether the latest scheduled step is one to watch (`_watches`)."""
        return self._watches(self.policy.slo_snapshot)

    def _watches(self, snapshot) -> bool:
        """A step the monitor may cut: it has a prefill chunk and no order was issued for it
        yet (the policy's snapshot is replaced whole: read it once per decision)."""
        return (snapshot is not None and bool(snapshot.prefills)
                and snapshot.step_id != self._last_ordered_step)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(self.poll_seconds if self.watching() else None)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.num_checks += 1
                self.check_once(self.clock())
            except Exception:  # noqa: BLE001 - a monitor bug must never kill serving
                logger.exception("SLO monitor check failed")

    def check_once(self, now: float) -> Optional[CutOrder]:
        """One look at the step in flight; issues (and returns) at most one order per step."""
        snapshot = self.policy.slo_snapshot
        if not self._watches(snapshot):
            return None
        waiters = snapshot.waiters + tuple(
            slo.WaiterView(r.request_id, r.ttft_deadline, r.num_tokens)
            for r in self.arrivals())
        rest_of_step = max(0.0, snapshot.predicted_seconds - (now - snapshot.started_at))
        decision, waiter_id = self.policy.slo_decide(snapshot.prefills, waiters, now,
                                                     rest_of_step)
        if not decision.fire:
            return None
        order = CutOrder(snapshot.step_id, decision.victim_id, waiter_id, now)
        self.signal.order(order)
        self._last_ordered_step = snapshot.step_id
        self.num_orders += 1
        return order


def load_ttft_profile(path: str) -> tuple[float, float, float]:
    """(a seconds per token, c seconds, b seconds per token squared) from a JSON profile.
    Accepted layouts: {"ttft": {"a": ..., "c": ..., "b": ... (optional, 0)}} or
    {"ttft_a_s_per_token": ..., "ttft_c_s": ...}."""
    import json

    with open(path) as f:
        data = json.load(f)
    if isinstance(data.get("ttft"), dict):
        ttft = data["ttft"]
        return float(ttft["a"]), float(ttft["c"]), float(ttft.get("b", 0.0))
    if "ttft_a_s_per_token" in data:
        return float(data["ttft_a_s_per_token"]), float(data["ttft_c_s"]), 0.0
    raise ValueError(f"{path}: no TTFT predictor in the profile (expected a 'ttft' object with "
                     f"'a' and 'c', or 'ttft_a_s_per_token' and 'ttft_c_s')")


def resolve_ttft_predictor(config, measure: Callable[[], tuple[float, float]]
                           ) -> slo.TTFTPredictor:
    """Explicit coefficients win, then the profile, then `measure()` (start-up timing, a
    line). The quadratic term: `slo_ttft_b_us_per_token2` when not 0, else the profile's."""
    a_ms, c_ms = config.slo_ttft_a_ms_per_token, config.slo_ttft_c_ms
    b = config.slo_ttft_b_us_per_token2 / 1e6
    if a_ms is not None and c_ms is not None:
        return slo.TTFTPredictor(a_ms / 1000, c_ms / 1000, b)
    if config.slo_ttft_profile:
        a, c, profile_b = load_ttft_profile(config.slo_ttft_profile)
        b = b or profile_b
    else:
        a, c = measure()
    return slo.TTFTPredictor(a if a_ms is None else a_ms / 1000,
                             c if c_ms is None else c_ms / 1000, b)
