"""The messages between the API process and the engine core process of `tokenweir serve
--engine-process` (engine/core_client.py, engine/core_process.py), and what both sides of an
AsyncEngine share. Torch-free.

Every message is a tuple, pickled over one multiprocessing Pipe; each direction keeps its order.

API -> core:
  ("add", Request)                        a request made (tokenized, validated) by the API side;
                                          its samples, if any, travel inside it (Request.group)
  ("abort", output_id, [scheduler ids])   abort a request (a group: all its samples)
  ("finish", [(scheduler id, message)])   the output side ended these: "" a stop string, else
                                          the error that failed their output processing
  ("call", call_id, name)                 a question answered between steps (CALLS)
  ("shutdown",)                           abort everything, answer ("bye",), exit
core -> API:
  ("ready", ReadyInfo)  or  ("error", exception class name, message)      once, first
  ("tick", [event, ...], metrics snapshot)  after each loop turn that did something; events:
      ("step", [record, ...], now)          one step's outputs (`to_record`), `now` its clock
      ("abort", output_id)                  an "abort" message applied
      ("abort_all", None)                   the shutdown's abort of everything left
      ("fail", [output ids], message)       a step raised: these requests failed
      ("reply", call_id, value)             the answer to a ("call", ...)
  ("bye",)                                  last, after a ("shutdown",)

Contract: the core applies the API's messages in order, submitted requests before an abort or
finish that follows them (so an abort always finds its request, as in AsyncEngine's engine
thread). Both processes read `time.monotonic` (one clock on Linux), so timestamps compare.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.request import Request, RequestStatus

logger = logging.getLogger("tokenweir")

# ("call", id, name) names the core answers: the tokenizer as `Tokenizer.to_cache` gives it
# (for an API process that found none in the load cache), the live timeline's trace.
CALLS = ("tokenizer", "timeline")


@dataclass(frozen=True)
class ReadyInfo:
    """What the API side needs of the built engine."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset
    has_tokenizer: bool
    ttft_predictor: Any  # core.sched.slo.TTFTPredictor when the policy is deadline-aware
    metrics: list
    pid: int


# A record: what one EngineCoreOutput tells the API side's copy of its request (the fields the
# output processor reads), in this order.
_FIELDS = ("status", "stop_reason", "error", "num_cached_tokens", "num_preemptions",
           "first_scheduled_time", "first_token_time", "finished_time")


def to_record(out: EngineCoreOutput) -> tuple:
    """(request id, new token ids, logprobs, finish reason, output length, forked, fields)."""
    request = out.request
    forked = request.group.forked if request.group is not None else False
    return (request.request_id, out.new_token_ids, out.logprobs, out.finish_reason,
            request.num_output_tokens, forked, tuple(getattr(request, f) for f in _FIELDS))


def apply_record(mirror: Request, record: tuple) -> EngineCoreOutput:
    """Bring the API side's copy of a request to the core's state after one step; the
    EngineCoreOutput the output processor folds. The copy's output tokens end as the core's:
    the ones it had before this step, then this step's new ones."""
    _, new_ids, logprobs, finish_reason, output_len, forked, values = record
    kept = len(mirror.prompt_token_ids) + output_len - len(new_ids)
    if len(mirror.all_token_ids) < kept:
        raise RuntimeError(f"request {mirror.request_id}: the API side holds "
                           f"{len(mirror.all_token_ids)} tokens, the core {kept} before this step")
    del mirror.all_token_ids[kept:]
    mirror.all_token_ids.extend(new_ids)
    for name, value in zip(_FIELDS, values):
        setattr(mirror, name, value)
    if forked and mirror.group is not None:
        mirror.group.forked = True
    return EngineCoreOutput(mirror, list(new_ids), logprobs, finish_reason)


# ---- what the engine thread (in-process) and the core process (out of it) both do ----------
def apply_finishes(core, finishes: list[tuple[str, str]]) -> None:
    """Finish in the scheduler what the output side ended: ("id", "") for a stop string,
    ("id", message) for a request whose output processing failed."""
    for request_id, message in finishes:
        if message:
            core.fail_requests({request_id: message})
        else:
            core.abort_requests([request_id], RequestStatus.FINISHED_STOPPED)


def abort_after_failed_step(core) -> list[str]:
    """A step raised: abort every request in the scheduler; the output ids to fail."""
    from tokenweir.engine.output_processor import OutputProcessor

    logger.exception("engine step failed; aborting in-flight requests")
    requests = list(core.scheduler.requests.values())
    for request in requests:
        try:
            core.abort_requests([request.request_id])
        except Exception:  # noqa: BLE001
            logger.exception("abort after a failed step failed")
    return list(dict.fromkeys(map(OutputProcessor.output_id, requests)))


def error_from(kind: str, message: str) -> Exception:
    """The exception an ("error", kind, message) stands for: ValueError stays one (a refusal
    only the load could tell, answered like the in-process build's); anything else is a
    RuntimeError naming its class."""
    if kind == "ValueError":
        return ValueError(message)
    return RuntimeError(f"the engine core failed to start: {kind}: {message}")


def sample_ids(request: Request) -> Optional[list[str]]:
    """The scheduler ids behind a parallel-sampling request (None for a lone one)."""
    return None if request.group is None else [s.request_id for s in request.group.samples]
