"""EngineThread: the one thread that runs the model in a server process.

Contract: every torch computation of a served engine happens on this thread: building the
engine (model load, kernel build, the start-up warm-up, start-up measurements) with `call`,
then the engine loop with `submit`. Why one thread: libgomp gives every thread that opens an
OpenMP parallel region a team of worker threads of its own, and when the process holds more
such threads than cores it throttles their spin-wait to almost nothing, so each of a step's
hundreds of parallel regions waits for its workers to wake from sleep. Measured on a 2-core
AVX-512 machine, SmolLM2-135M in bfloat16, a 24-request decode step: 29 ms when one thread did
everything, 45 ms when the engine was built on the main thread and stepped on another (the
server's layout before; its median TPOT at 0.7x saturation was 2.2x vLLM's).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional


class EngineThread(threading.Thread):
    """A daemon thread named "tokenweir-engine" that runs the jobs handed to it, in order."""

    def __init__(self) -> None:
        super().__init__(name="tokenweir-engine", daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            job: Optional[tuple[Callable[[], Any], Future]] = self._jobs.get()
            if job is None:
                return
            fn, done = job
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run fn on this thread after the jobs before it; its Future."""
        done: Future = Future()
        self._jobs.put((fn, done))
        return done

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on this thread and wait: its result, or its exception raised here."""
        return self.submit(fn).result()

    def stop(self) -> None:
        """Let the thread end once the jobs already handed to it are done."""
        self._jobs.put(None)


def wants_output_thread(mode: str, engine_thread: EngineThread) -> bool:
    """Whether a server processes outputs on a thread of its own (config.OUTPUT_THREAD_MODES).
    "auto": only where the machine has a core beyond the engine thread's torch threads. With
    none spare, the output thread's work runs while the forward's OpenMP team waits at its
    barriers for the core it took: measured on a 2-core machine, SmolLM2-135M in bfloat16,
    ~22-request decode steps at ~3 req/s took 30.0-34.7 ms with the thread and 28.3-30.3 ms
    with outputs processed between steps (3 interleaved pairs)."""
    if mode != "auto":
        return mode == "on"
    import torch

    torch_threads = engine_thread.call(torch.get_num_threads)
    return len(os.sched_getaffinity(0)) > torch_threads
