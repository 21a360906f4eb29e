"""Where a served token's time goes: a breakdown of the serving path by phase.

`ServingProfile` accumulates seconds per named phase from any thread (one lock; a few
hundred observations per step at most). The engine core's three parts come from its step
observer hook: `ServingProfile.observe_step` is one of `EngineCore.step_observers` (next to the
step tracer, when one records), reading the clock readings the core takes anyway; `attach` and
`detach` add and remove it.

Phases (the table `format_profile` prints):
- schedule, forward, update: the engine core step (engine thread), from the observer's clock
  readings; `update` runs from the forward's end to the observer call (the scheduler's update
  and the step's metrics); a failed forward is not observed, so not counted;
- output processing: detokenization, stop strings, building each RequestOutput, latency stats
  (the output thread, or the engine thread when there is none);
- handoff: handing outputs to the output thread / event loop (engine or output thread);
- metrics snapshot: refreshing the Prometheus snapshot after each step;
- engine idle: the engine thread waiting for work (no request in flight);
- loop delivery: the event loop routing a batch of outputs to request queues;
- SSE writing: serializing and yielding each streamed chunk (event loop);
and two latencies that are not CPU time but waiting: loop wait (a batch posted -> the loop
runs its delivery) and token -> wire (a batch posted -> its chunk is handed to the socket).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The phases in the order they are printed, and the thread each runs on.
PHASES: tuple[tuple[str, str], ...] = (
    ("schedule", "engine"), ("forward", "engine"), ("update", "engine"),
    ("output processing", "output"), ("handoff", "engine/output"),
    ("metrics snapshot", "engine"), ("engine idle", "engine"),
    ("loop delivery", "event loop"), ("SSE writing", "event loop"))
LATENCIES = ("loop wait", "token -> wire")


@dataclass
class _Latency:
    """Seconds of waiting, sampled: count, total, max, and the samples for percentiles."""

    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        if len(self.samples) < 200_000:
            self.samples.append(seconds)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"count": 0, "mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
        s = sorted(self.samples)
        return {"count": len(s), "mean_ms": 1000 * sum(s) / len(s),
                "p50_ms": 1000 * s[len(s) // 2], "p99_ms": 1000 * s[min(len(s) - 1,
                                                                         int(len(s) * 0.99))]}


class ServingProfile:
    """Thread-safe totals per phase plus step and token counts. `started` is the wall clock
    the shares are taken against (reset() moves it: call it after a warm-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.seconds: dict[str, float] = {name: 0.0 for name, _ in PHASES}
            self.latencies: dict[str, _Latency] = {name: _Latency() for name in LATENCIES}
            self.steps = 0
            self.tokens = 0
            self.started = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    def wait(self, latency: str, seconds: float) -> None:
        with self._lock:
            self.latencies[latency].add(seconds)

    def count_step(self, tokens: int) -> None:
        with self._lock:
            self.steps += 1
            self.tokens += tokens

    def observe_step(self, scheduler_output: Any, runner_output: Any, outputs: list,
                     times: tuple[float, float, float, float]) -> None:
        """An EngineCore step observer: the step's schedule, forward and update seconds from
        its clock readings (started, scheduled, executed, updated)."""
        started, scheduled, executed, updated = times
        with self._lock:
            self.seconds["schedule"] += scheduled - started
            self.seconds["forward"] += executed - scheduled
            self.seconds["update"] += updated - executed

    def attach(self, core: Any) -> None:
        """Observe every step of `core` (an EngineCore) from now on."""
        core.step_observers.append(self.observe_step)

    def detach(self, core: Any) -> None:
        core.step_observers.remove(self.observe_step)

    def snapshot(self) -> dict[str, Any]:
        """Everything as JSON-ready numbers: per phase total s, share of wall, ms per step and
        us per token; the latencies' mean, p50 and p99 in ms."""
        with self._lock:
            wall = max(1e-9, time.perf_counter() - self.started)
            steps, tokens = max(1, self.steps), max(1, self.tokens)
            phases = {name: {"thread": thread, "seconds": self.seconds[name],
                             "share_of_wall": self.seconds[name] / wall,
                             "ms_per_step": 1000 * self.seconds[name] / steps,
                             "us_per_token": 1e6 * self.seconds[name] / tokens}
                      for name, thread in PHASES}
            latencies = {name: lat.summary() for name, lat in self.latencies.items()}
            return {"wall_s": wall, "steps": self.steps, "tokens": self.tokens,
                    "tokens_per_step": self.tokens / steps, "phases": phases,
                    "latencies": latencies}


def format_profile(snap: dict[str, Any]) -> str:
    """The breakdown as a table (the --profile-serving report)."""
    lines = [f"serving profile: {snap['steps']} steps, {snap['tokens']} tokens "
             f"({snap['tokens_per_step']:.1f}/step) in {snap['wall_s']:.1f} s wall",
             f"{'phase':<20}{'thread':<15}{'total s':>9}{'% wall':>8}{'ms/step':>9}"
             f"{'us/token':>10}"]
    for name, p in snap["phases"].items():
        lines.append(f"{name:<20}{p['thread']:<15}{p['seconds']:>9.2f}"
                     f"{100 * p['share_of_wall']:>7.1f}%{p['ms_per_step']:>9.2f}"
                     f"{p['us_per_token']:>10.1f}")
    for name, lat in snap["latencies"].items():
        lines.append(f"{name:<20}{'(latency)':<15} n={lat['count']}  mean {lat['mean_ms']:.2f} "
                     f"ms  p50 {lat['p50_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms")
    return "\n".join(lines)
