"""One engine step: schedule -> execute -> update. The runner is anything with
`execute(SchedulerOutput) -> ModelRunnerOutput` (the real model runner or the simulator's)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterable, Protocol

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.scheduler import EngineCoreOutput, Scheduler
from tokenweir.engine.metrics import EngineMetrics
from tokenweir.request import Request, RequestStatus


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

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

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
        return bool(self.inbox) or self.scheduler.has_unfinished_requests()

    def admit_submitted(self) -> None:
        """Hand the submitted requests to the scheduler (on the stepping thread, between
        steps)."""
        while self.inbox:
            self.scheduler.add_request(self.inbox.popleft())

    def step(self) -> list[EngineCoreOutput]:
        self.admit_submitted()
        scheduler_output = self.scheduler.schedule(now=self.clock())
        runner_output = self.executor.execute(scheduler_output)
        cut = runner_output.cut
        if cut is not None:  # the step never happened, except for the work it wasted
            self.scheduler.roll_back_cut_step(scheduler_output, cut.victim_id, cut.layer_index,
                                              cut.num_layers, cut.waiter_id)
            outputs = []
        else:
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output,
                                                        now=self.clock())
        self.metrics.record_step(scheduler_output, runner_output, self.scheduler)
        return outputs
