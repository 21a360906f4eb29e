"""One engine step: schedule -> execute -> update. The runner is anything with
`execute(SchedulerOutput) -> ModelRunnerOutput` (the real model runner or the simulator's).

Fault isolation (contract): a failure while handling one request fails that request alone; it
finishes with status FINISHED_ERROR, finish reason "error" and `Request.error` set, and leaves
the scheduler through `finish_requests`, which frees its blocks. The rest of the step goes on:

- admission: a submitted request the scheduler refuses fails alone;
- sampling: the runner reports the requests whose sampling failed (`request_errors`);
- the scheduler's update (stop rules): each request is guarded inside
  `Scheduler.update_from_output` (core/sched/failure.py);
- a failure of the forward itself (`execute` raised) fails the requests of that step, and
  the engine serves the next step as usual.
  It is not retried: a swap-out's source blocks may have been handed on and written by the
  failed forward (a second copy would save garbage), the runner may have taken in part of the
  step's state, and a failure on CPU (a bug, memory, a bad input) is rarely transient; a retry
  would double the time to the same error.

Detokenization and output building are isolated one layer up (LLMEngine.step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional, Protocol

from tokenweir import faults
from tokenweir.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.engine.metrics import EngineMetrics
from tokenweir.request import INVALID_REQUEST, Request, RequestStatus

logger = logging.getLogger("tokenweir")


def error_http_status(message: Optional[str]) -> int:
    """The HTTP status a failed request's error maps to: 400 when the request was invalid,
    else 500."""
    return 400 if message is not None and message.startswith(INVALID_REQUEST) else 500


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.metrics = EngineMetrics()
        # Requests submitted from other threads; handed to the scheduler at the next step.
        self.inbox: deque[Request] = deque()
        self.arrival_event = threading.Event()  # set on each submit (wakes the SLO monitor)
        # Each is called on the stepping thread right after schedule(), before the step runs
        # (the SLO monitor's `step_scheduled`: it watches steps it may cut).
        self.schedule_listeners: list[Callable[[], None]] = []
        # Every request handed to the scheduler, until it shows up in a SchedulerOutput's
        # finished_req_ids: lets the runner's failures (sampling, forward) name requests by id.
        self._requests: dict[str, Request] = {}
        # Outputs of requests that failed outside a step (at admission), returned by the next.
        self._failed: list[EngineCoreOutput] = []
        # [trace] Each is called once per step that ran (not a failed forward), after the
        # update, in list order: observer(scheduler_output, runner_output, outputs, (started,
        # scheduled, executed, updated)), the four on `clock`. The observers: the step tracer
        # (timeline/tracer.py) and the serving profile (engine/serving_profile.py).
        self.step_observers: list[Callable[..., None]] = []

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        if request.group is not None:  # parallel sampling: the samples it forks into
            self._requests.update((s.request_id, s) for s in request.group.samples[1:])

    def submit(self, request: Request) -> None:
        """Thread-safe add: may be called while step() runs (the SLO monitor sees it at once,
        the scheduler at the next step)."""
        self.inbox.append(request)
        self.arrival_event.set()

    def pending_arrivals(self) -> list[Request]:
        return list(self.inbox)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.inbox) or bool(self._failed) or \
            self.scheduler.has_unfinished_requests()

    def admit_submitted(self) -> None:
        """Hand the submitted requests to the scheduler (on the stepping thread, between
        steps). One the scheduler refuses fails alone; the next step returns its output."""
        while self.inbox:
            request = self.inbox.popleft()
            try:
                if faults.ARMED:
                    faults.fire("admit", request.request_id)
                self.add_request(request)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._failed.append(self._fail_unadmitted(request, exc))

    def step(self, decoded: Optional[list[str]] = None) -> list[EngineCoreOutput]:
        """One step's outputs. `decoded`: a list the scheduler's update appends the ids of
        plain decodes to instead of returning their outputs (Scheduler.update_from_output;
        only requests without `needs_token_outputs`); ignored while a step observer watches
        the outputs (they would miss those tokens)."""
        self.admit_submitted()
        failed, self._failed = self._failed, []
        started = self.clock()  # [trace] also the scheduler's `now`
        scheduler_output = self.scheduler.schedule(now=started)
        scheduled = self.clock()  # [trace]
        for listener in self.schedule_listeners:
            listener()
        for request_id in scheduler_output.finished_req_ids:
            self._requests.pop(request_id, None)
        try:
            runner_output = self.executor.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the forward failed: fail its requests
            return failed + self._fail_step(scheduler_output, exc)
        executed = self.clock()  # [trace]
        cut = runner_output.cut
        if cut is not None:  # the step never happened, except for the work it wasted
            self.scheduler.roll_back_cut_step(scheduler_output, cut.victim_id, cut.layer_index,
                                              cut.num_layers, cut.waiter_id)
            outputs = []
        else:
            if runner_output.request_errors:
                failed += self.fail_requests(runner_output.request_errors)
            if decoded is None or self.step_observers:
                outputs = self.scheduler.update_from_output(scheduler_output, runner_output,
                                                            now=self.clock())
            else:
                outputs = self.scheduler.update_from_output(scheduler_output, runner_output,
                                                            self.clock(), decoded)
        self.metrics.record_step(scheduler_output, runner_output, self.scheduler)
        if self.step_observers:  # [trace]
            times = (started, scheduled, executed, self.clock())
            for observer in self.step_observers:
                observer(scheduler_output, runner_output, outputs, times)
        return failed + outputs

    # ---- failures -----------------------------------------------------------------------
    def fail_requests(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish each named request with an error (request id -> message): removed from the
        scheduler, blocks freed, one final "error" output each. Finished or unknown ids are
        skipped."""
        outputs = []
        now = self.clock()
        for request_id, message in errors.items():
            request = self._requests.get(request_id)
            if request is None or request.is_finished:
                continue
            logger.warning("request %s failed: %s", request_id, message)
            request.error = message
            request.finished_time = now
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(request, [], finish_reason="error"))
        return outputs

    def _fail_unadmitted(self, request: Request, exc: Exception) -> EngineCoreOutput:
        logger.warning("request %s refused at admission: %r", request.request_id, exc)
        request.status = RequestStatus.FINISHED_ERROR
        reason = INVALID_REQUEST if isinstance(exc, ValueError) else "admission failed"
        request.error = f"{reason}: {exc}"
        request.finished_time = self.clock()
        return EngineCoreOutput(request, [], finish_reason="error")

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   exc: Exception) -> list[EngineCoreOutput]:
        """The forward (or the swaps before it) raised: every request of the step fails; so do
        the ones swapped out in it (their host copy may be incomplete)."""
        logger.error("step %d failed in the runner: %r", scheduler_output.step_id, exc,
                     exc_info=exc)
        victims = list(scheduler_output.num_scheduled_tokens)
        if scheduler_output.blocks_to_swap_out:
            victims += sorted(scheduler_output.preempted_req_ids)
        message = f"the model forward failed in step {scheduler_output.step_id}: {exc!r}"
        return self.fail_requests({request_id: message for request_id in victims})
