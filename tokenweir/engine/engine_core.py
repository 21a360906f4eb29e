"""One engine step: schedule -> execute -> update. The runner is anything with
`execute(SchedulerOutput) -> ModelRunnerOutput` (the real model runner or the simulator's).

Fault isolation (contract): a failure while handling one request fails that request alone; it
finishes with status FINISHED_ERROR, finish reason "error" and `Request.error` set, and leaves
the scheduler through `finish_requests`, which frees its blocks. The rest of the step goes on:

- admission: a submitted request the scheduler refuses fails alone;
- sampling: the runner reports the requests whose sampling failed (`request_errors`);
- the scheduler's update (stop rules): see `_update_isolated`;
- a failure of the forward itself (`execute` raised) fails the requests of that step, and
  the engine serves the next step as usual.

Detokenization and output building are isolated one layer up (LLMEngine.step).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional, Protocol

from tokenweir import faults
from tokenweir.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.engine.metrics import EngineMetrics
from tokenweir.request import Request, RequestStatus

logger = logging.getLogger("tokenweir")


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
        # Every request handed to the scheduler, until it shows up in a SchedulerOutput's
        # finished_req_ids: lets a failed update find the requests it already finished.
        self._requests: dict[str, Request] = {}
        # Outputs of requests that failed outside a step (at admission), returned by the next.
        self._failed: list[EngineCoreOutput] = []

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

    def step(self) -> list[EngineCoreOutput]:
        self.admit_submitted()
        failed, self._failed = self._failed, []
        scheduler_output = self.scheduler.schedule(now=self.clock())
        for request_id in scheduler_output.finished_req_ids:
            self._requests.pop(request_id, None)
        try:
            runner_output = self.executor.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the forward failed: fail its requests
            return failed + self._fail_step(scheduler_output, exc)
        cut = runner_output.cut
        if cut is not None:  # the step never happened, except for the work it wasted
            self.scheduler.roll_back_cut_step(scheduler_output, cut.victim_id, cut.layer_index,
                                              cut.num_layers, cut.waiter_id)
            outputs = []
        else:
            if runner_output.request_errors:
                failed += self.fail_requests(runner_output.request_errors)
            outputs = self._update_isolated(scheduler_output, runner_output)
        self.metrics.record_step(scheduler_output, runner_output, self.scheduler)
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
        request.error = f"admission failed: {exc}"
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

    # ---- update ---------------------------------------------------------------------------
    def _update_isolated(self, scheduler_output: SchedulerOutput,
                         runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """update_from_output, with one request's failure confined to that request.

        Relies on update_from_output's contract: it walks `num_scheduled_tokens` in order, one
        request at a time, advancing a request's num_computed_tokens before anything else about
        it can fail, and reads only `num_scheduled_tokens` from the SchedulerOutput; a runner
        samples at most one token per request per step. When it raises, the requests it had
        finished with are recovered, the culprit fails, and the rest are updated one by one.
        """
        try:
            return self.scheduler.update_from_output(scheduler_output, runner_output,
                                                     now=self.clock())
        except Exception as exc:  # noqa: BLE001 - find the request to blame
            return self._recover_update(scheduler_output, runner_output, exc)

    def _recover_update(self, scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput,
                        exc: Exception) -> list[EngineCoreOutput]:
        # The requests the update walked or would have walked (not the ones the runner failed).
        order = [r for r in scheduler_output.num_scheduled_tokens if r in self._requests
                 and self._requests[r].status != RequestStatus.FINISHED_ERROR]
        computed_before = _computed_before(scheduler_output)
        touched = [i for i, r in enumerate(order)
                   if self._was_updated(self._requests[r], computed_before.get(r))]
        last = touched[-1] if touched else -1
        outputs = [o for r in order[:last] if (o := self._recovered_output(r, runner_output))]
        suspect = order[last] if last >= 0 and not self._requests[order[last]].is_finished \
            else None
        if last >= 0 and suspect is None:
            outputs += filter(None, [self._recovered_output(order[last], runner_output)])
        rest = [r for r in order[last + 1:] if self._requests[r].status == RequestStatus.RUNNING]
        first_failed = False
        for i, request_id in enumerate(rest):
            one = dataclasses.replace(
                scheduler_output, num_scheduled_tokens={
                    request_id: scheduler_output.num_scheduled_tokens[request_id]},
                total_num_scheduled_tokens=scheduler_output.num_scheduled_tokens[request_id])
            try:
                outputs += self.scheduler.update_from_output(one, runner_output,
                                                             now=self.clock())
            except Exception as alone_exc:  # noqa: BLE001 - this one fails on its own
                first_failed = first_failed or i == 0
                outputs += self.fail_requests({request_id: _update_error(alone_exc)})
        if suspect is not None:
            if first_failed:  # the update broke on the next request, not on this one
                outputs += filter(None, [self._recovered_output(suspect, runner_output)])
            else:
                outputs += self.fail_requests({suspect: _update_error(exc)})
        return outputs

    @staticmethod
    def _was_updated(request: Request, computed_before: Optional[int]) -> bool:
        return request.is_finished or request.num_computed_tokens != computed_before

    def _recovered_output(self, request_id: str,
                          runner_output: ModelRunnerOutput) -> Optional[EngineCoreOutput]:
        """The output update_from_output made for a request before it raised on a later one:
        its one sampled token (if any), appended already, and its finish reason."""
        request = self._requests[request_id]
        if not runner_output.sampled_token_ids.get(request_id):
            return None
        return EngineCoreOutput(request, request.all_token_ids[-1:],
                                logprobs=runner_output.logprobs.get(request_id),
                                finish_reason=request.status.finish_reason)


def _computed_before(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Request id -> num_computed_tokens before this step, as the SchedulerOutput tells it."""
    before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    before.update(zip(scheduler_output.cached_req_ids,
                      scheduler_output.cached_num_computed_tokens))
    return before


def _update_error(exc: Exception) -> str:
    return f"updating the request after its step failed (stop rules): {exc!r}"
