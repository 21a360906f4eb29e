"""The engine core process of `tokenweir serve --engine-process`: it builds the LLMEngine and
runs its step loop; the API process (engine/core_client.py) keeps HTTP, tokenizing,
detokenizing and metrics. Messages: engine/core_protocol.py.

Contract: every torch computation of this process runs on its main thread (the build, then the
loop), as EngineThread gives the in-process server (engine_thread.py says why). The loop is
AsyncEngine's engine thread, with the pipe for its deques: it applies the API's messages in
order between steps, steps while anything is unfinished, and sends one "tick" per turn that did
something. It sleeps in `poll` when idle. SIGINT is ignored (a terminal's Ctrl-C reaches the
whole process group; the API process drains, then sends "shutdown"); the pipe's end (the API
process gone) ends the loop.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from tokenweir import startup_gc  # (gc, os, contextlib: _build's pause starts before anything)
from tokenweir.engine.core_protocol import (ReadyInfo, abort_after_failed_step, apply_finishes,
                                            to_record)

logger = logging.getLogger("tokenweir")

# The tokenizer is the API process's work: here it is built only if something needs it (a
# guided request's vocabulary, the API process asking for it), off the start's critical path.
# False: built with the engine, as before (for A/B runs: benchmarks/startup.py --patch).
# Measured (startup.py --timeline, warm serve, exclusive, 3 rounds): the core's LLMEngine build
# 0.21-0.28 s with it (Tokenizer.from_cache 0.15-0.21 s of that), 0.06-0.07 s deferred.
DEFER_TOKENIZER = True


def core_main(config, conn, api_end, timeline_steps: int, log_level: str) -> None:
    """The process's target: build, say "ready" (or "error"), then loop until "shutdown".
    `api_end`: the API process's end of the pipe, inherited by the fork: closed here, so that
    the API process's death ends the pipe."""
    api_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s (core): %(message)s")
    try:
        engine = _build(config)
    except BaseException as exc:  # noqa: BLE001 - told to the API process, which refuses
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    ring = None
    if timeline_steps > 0:
        from tokenweir.timeline.records import StepRing

        ring = StepRing(capacity=timeline_steps)
        engine.add_trace_sink(ring)
    conn.send(("ready", ready_info(engine)))
    try:
        CoreLoop(engine, conn, ring).run()
    except (EOFError, OSError):  # the API process is gone: nobody to serve
        logger.warning("the API process closed the pipe; the engine core stops")
    finally:
        engine.shutdown()


def _build(config):
    with startup_gc.paused():  # as the in-process build (startup_gc.py), imports included
        from tokenweir.model import prefetch

        prefetch.start_for_model(config.model.model, config.model.dtype,
                                  config.model.device)  # the load cache checked while torch imports
        from tokenweir.engine.llm_engine import LLMEngine

        return LLMEngine(config, defer_tokenizer=DEFER_TOKENIZER)


def ready_info(engine) -> ReadyInfo:
    policy = engine.scheduler.policy
    return ReadyInfo(model_name=engine.model_name, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size, eos_token_ids=engine.eos_token_ids,
                     has_tokenizer=engine.tokenizer is not None,
                     ttft_predictor=getattr(policy, "ttft_predictor", None)
                     if policy.deadline_aware else None,
                     metrics=engine.get_metrics(), pid=os.getpid())


class CoreLoop:
    def __init__(self, engine, conn, ring=None) -> None:
        self.engine = engine
        self.core = engine.core
        self.conn = conn
        self.ring = ring
        self.events: list[tuple] = []

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self.conn.poll(None)  # idle: sleep until the API process writes
            if self._read_messages():
                self._shut_down()
                return
            stepped = engine.has_unfinished_requests()
            if stepped:
                self._step()
            if stepped or self.events:
                self._send_tick()

    def _read_messages(self) -> bool:
        """Apply every message waiting, in order; True at "shutdown"."""
        core = self.core
        while self.conn.poll(0):
            kind, *args = self.conn.recv()
            if kind == "add":
                core.submit(args[0])
            elif kind == "abort":
                core.admit_submitted()  # an abort always finds the request it names
                core.abort_requests(args[1])
                self.events.append(("abort", args[0]))
            elif kind == "finish":
                core.admit_submitted()
                apply_finishes(core, args[0])
            elif kind == "call":
                self.events.append(("reply", args[0], self._answer(args[1])))
            elif kind == "shutdown":
                return True
        return False

    def _answer(self, name: str) -> Any:
        if name == "tokenizer":
            tokenizer = self.engine.tokenizer
            return None if tokenizer is None else tokenizer.to_cache()
        if name == "timeline":
            return None if self.ring is None else self.ring.trace({"label": "live"})
        raise ValueError(f"unknown call {name!r}")

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
            self.events.append(("fail", abort_after_failed_step(core), str(exc)))
            return
        self.events.append(("step", [to_record(out) for out in outputs], core.clock()))

    def _send_tick(self) -> None:
        events, self.events = self.events, []
        self.conn.send(("tick", events, self.engine.get_metrics()))

    def _shut_down(self) -> None:
        self.core.admit_submitted()
        ids = list(self.engine.scheduler.requests)
        self.core.abort_requests(ids)
        self.events.append(("abort_all", None))
        self._send_tick()
        self.conn.send(("bye",))

