"""A request whose handling failed inside the scheduler fails alone (issue 14).

`Scheduler.update_from_output` runs each request's update in its own guard and hands a failure
here; nothing else of the step is touched."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenweir.core.sched.scheduler import Scheduler

logger = logging.getLogger("tokenweir")

UPDATE_FAILED = "updating the request after its step failed (stop rules)"


def fail_in_update(scheduler: "Scheduler", request: Request, exc: Exception,
                   now: float) -> EngineCoreOutput:
    """`request`'s update raised `exc` (a stop rule on corrupt parameters, a bug): it finishes
    with FINISHED_ERROR (blocks freed, out of `running`) unless the update had finished it
    already; `Request.error` says why. Returns its final output: finish reason "error", no
    tokens (the token sampled for it this step is dropped)."""
    logger.warning("request %s failed in the scheduler's update: %r", request.request_id, exc,
                   exc_info=exc)
    request.error = f"{UPDATE_FAILED}: {exc!r}"
    request.finished_time = now
    if request.request_id in scheduler.requests:
        if request.status == RequestStatus.RUNNING:
            scheduler.running.remove(request)
        scheduler._finish(request, RequestStatus.FINISHED_ERROR)
    else:
        request.status = RequestStatus.FINISHED_ERROR
    return EngineCoreOutput(request, [], finish_reason="error")
