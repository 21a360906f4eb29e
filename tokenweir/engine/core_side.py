"""The core's side of an AsyncEngine: what owns the scheduler and steps it. One interface, two
implementations, so that AsyncEngine (engine/async_engine.py, "the front") never asks which:
- `LocalCore`: the engine loop on an EngineThread of this process, over an LLMEngine;
- `RemoteCore`: the engine core process (engine/core_process.py) over a RemoteEngine's
  CoreClient (engine/core_client.py).

Contract of a side (called from any thread unless said):
- `start(front)`, once, on the event loop: begin; returns a Future that is done once the side
  has ended. From then on the side hands the front, in the order the engine made them, the
  output side's messages (`front.to_output`: ("step", (core outputs, now)) or ("records",
  (records, now)), ("abort", output id), ("abort_all", None), ("fail", (output ids, exc))),
  refreshes `front.metrics_snapshot`, and calls `front.core_ended(reason)` once, last (reason
  None after `stop`, else why the core died).
- `submit(request, text)`: hand an admitted request to the engine; False (nothing handed)
  once stopping.
- `abort([(output id, scheduler ids), ...])`: end these requests (no-op for unknown ones); each
  one's ("abort", output id) message reaches the output side after its earlier outputs.
- `finish(scheduler id, message)`: the output side ended this request ("" a stop string, else
  the error that failed its output processing): finish it in the scheduler at the next turn.
- `stop()`: abort everything left and end (idempotent); `stopping` is True from then on.
- `close()`: after `stop` (and the wait for the start's Future): release what the side holds.
- `outputs_dropped()`: the output side dropped output states without a final record (an abort,
  a failure): forget whatever the side keeps for them.
- `step_ring(capacity)`: what GET /timeline reads the last steps' records from (called once,
  before `start`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

from tokenweir.engine.core_protocol import abort_after_failed_step, apply_finishes
from tokenweir.engine.engine_thread import EngineThread

logger = logging.getLogger("tokenweir")


class LocalCore:
    """The engine loop on an EngineThread (in a server, the thread that built the engine: one
    thread for every torch computation, engine_thread.py). Other threads hand it aborts,
    finishes and the stop through deques guarded by `_cond`; it admits submitted requests
    before it handles aborts, so an abort always finds the request it names. It sleeps on the
    condition when there is nothing to do (no busy loop)."""

    def __init__(self, engine, engine_thread: Optional[EngineThread] = None) -> None:
        self.engine = engine
        self.core = engine.core  # an LLMEngine's (a RemoteEngine has none: use RemoteCore)
        self._cond = threading.Condition()
        self._aborts: collections.deque[tuple[str, list[str]]] = collections.deque()
        self._finishes: collections.deque[tuple[str, str]] = collections.deque()
        self._stopping = False
        self._thread = engine_thread or EngineThread()
        self._front: Any = None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self, front) -> Future:
        self._front = front
        running = self._thread.submit(self._run)
        self._thread.stop()  # the loop is its last job
        return running

    def submit(self, request, text: Optional[str]) -> bool:
        with self._cond:
            if self._stopping:
                return False
            self.engine.submit_request(request, text)
            self._cond.notify()
        return True

    def abort(self, pairs: list[tuple[str, list[str]]]) -> None:
        with self._cond:
            self._aborts.extend(pairs)
            self._cond.notify()

    def finish(self, request_id: str, message: str) -> None:
        with self._cond:
            self._finishes.append((request_id, message))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def close(self) -> None:
        if self._front is None:  # never started: the idle engine thread ends too
            self._thread.stop()

    def outputs_dropped(self) -> None:
        """Nothing kept here: the scheduler frees a request's state when it ends."""

    def step_ring(self, capacity: int):
        """A StepRing of the last `capacity` steps, fed by the engine's step observer."""
        from tokenweir.timeline.records import StepRing

        ring = StepRing(capacity=capacity)
        self.engine.add_trace_sink(ring)  # timeline/tracer.py
        return ring

    # ---- the engine thread ----------------------------------------------------------------
    # Owns the scheduler: every EngineCore call happens here. It never touches the output
    # processor: what a step produced goes to the output side (`front.to_output`) as a
    # message, and the output side asks back (`finish`) when a stop string or a processing
    # error ends a request.

    def _run(self) -> None:
        try:
            self._engine_loop()
        finally:
            self._front.core_ended(None)

    def _engine_loop(self) -> None:
        engine, core, front = self.engine, self.core, self._front
        while True:
            aborts, finishes, stopping = self._take_work()
            core.admit_submitted()
            apply_finishes(core, finishes)
            for request_id, sample_ids in aborts:
                core.abort_requests(sample_ids)
                front.to_output(("abort", request_id))
            if stopping:
                core.abort_requests(list(engine.scheduler.requests))
                front.to_output(("abort_all", None))
                self._refresh_metrics()
                return
            if engine.has_unfinished_requests():
                self._step()
            self._refresh_metrics()

    def _take_work(self) -> tuple[list, list[tuple[str, str]], bool]:
        """Sleep until there is something to do; then (aborts, finishes, stopping)."""
        started = time.perf_counter()
        with self._cond:
            while not self._aborts and not self._finishes and not self._stopping and not \
                    self.engine.has_unfinished_requests():
                self._cond.wait()
            aborts = list(self._aborts)
            self._aborts.clear()
            finishes = list(self._finishes)
            self._finishes.clear()
            stopping = self._stopping
        profile = self._front.profile
        if profile is not None:
            profile.add("engine idle", time.perf_counter() - started)
        return aborts, finishes, stopping

    def _step(self) -> None:
        core = self.core
        try:
            core_outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
            self._front.to_output(("fail", (abort_after_failed_step(core), exc)))
            return
        self._front.to_output(("step", (core_outputs, core.clock())))

    def _refresh_metrics(self) -> None:
        started = time.perf_counter()
        try:
            self._front.metrics_snapshot = self.engine.get_metrics()
        except Exception:  # noqa: BLE001
            logger.exception("metrics snapshot failed")
        profile = self._front.profile
        if profile is not None:
            profile.add("metrics snapshot", time.perf_counter() - started)


class RemoteCore:
    """The engine core process, over a RemoteEngine's CoreClient. The client's receiver thread
    stands for the engine thread: it hands each tick's events to the output side, in order.
    Requests go out as messages (core_protocol.py); the RemoteEngine keeps a copy of each,
    which `outputs_dropped` prunes."""

    def __init__(self, engine) -> None:
        self.engine = engine  # a RemoteEngine
        self.client = engine.client
        self._lock = threading.Lock()
        self._stopping = False
        self._front: Any = None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self, front) -> Future:
        self._front = front
        return self.client.attach(self._on_tick, self._on_end)

    def submit(self, request, text: Optional[str]) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self.engine.submit_request(request, text)
        return True

    def abort(self, pairs: list[tuple[str, list[str]]]) -> None:
        for request_id, sample_ids in pairs:
            self.client.send(("abort", request_id, sample_ids))

    def finish(self, request_id: str, message: str) -> None:
        self.client.send(("finish", [(request_id, message)]))

    def stop(self) -> None:
        with self._lock:
            stopping, self._stopping = self._stopping, True
        if not stopping:
            self.client.send(("shutdown",))

    def close(self) -> None:
        self.client.close()

    def outputs_dropped(self) -> None:
        self.engine.prune()

    def step_ring(self, capacity: int):
        """The core process records the steps (engine/core_process.py); read on demand."""
        return RemoteTimeline(self.client)

    # ---- the CoreClient's receiver thread --------------------------------------------------
    def _on_tick(self, events: list, metrics: list) -> None:
        front = self._front
        front.metrics_snapshot = metrics
        for event in events:
            kind = event[0]
            if kind == "step":
                message = ("records", (event[1], event[2]))
            elif kind == "fail":  # the step's exception, as the in-process path hands it on
                message = ("fail", (event[1], RuntimeError(event[2])))
            else:  # ("abort", output id), ("abort_all", None)
                message = event
            front.to_output_guarded(message)

    def _on_end(self, reason: Optional[str]) -> None:
        """The core said "bye" (reason None) or died (reason: why)."""
        self._front.core_ended(reason)


class RemoteTimeline:
    """`/timeline`'s ring, read from the core (its StepRing) between its steps, over a
    CoreClient."""

    def __init__(self, client) -> None:
        self.client = client

    def trace(self, meta: Optional[dict] = None):
        return self.client.call("timeline")
