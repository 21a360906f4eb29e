"""The API side of `tokenweir serve --engine-process` (as vLLM v1's API server beside its
EngineCore process): `CoreClient` starts the engine core process (engine/core_process.py) and
talks to it (engine/core_protocol.py); `RemoteEngine` is what AsyncEngine drives in place of an
LLMEngine. This process never imports torch: it imports the server stack, builds the tokenizer
(from the load cache when the entry is there, else asks the core for it) and serves HTTP while
the core imports torch and loads the model, on the other core.

Threads: a sender (every message goes out through its queue, in order, so that no caller
blocks on a full pipe) and a receiver (reads the core's messages: the answers to `call`, then
each tick handed to the attached handler). Contract: `wait_ready` returns once the core says
its engine is built; `attach(on_tick, on_end)` gets every tick after that, in order, and
`on_end(reason)` once, last: reason None after a shutdown's "bye", else why the core is gone
(it died: its exit status).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.engine.core_protocol import ReadyInfo, apply_record, error_from
from tokenweir.engine.input_processor import InputProcessor
from tokenweir.engine.output_processor import OutputProcessor
from tokenweir.request import Request

logger = logging.getLogger("tokenweir")

# Seconds a shut-down core may take to exit before it is terminated.
EXIT_TIMEOUT = 10.0
# RemoteEngine.connect lists the cached tokenizer's vocabulary for AsyncEngine's prompt bound
# before waiting for the core (False: after its "ready", as before; for A/B runs).
PRECOMPUTE_PROMPT_BOUND = True


class CoreDied(RuntimeError):
    """The engine core process ended without being asked to."""


class CoreClient:
    def __init__(self, proc, conn) -> None:
        self.proc = proc
        self.conn = conn
        self.pid = proc.pid
        self.ready: Future = Future()  # ReadyInfo, or the start's exception
        self.ended: Future = Future()  # None after "bye", else the death's reason (a str)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._handlers: Optional[tuple[Callable, Callable]] = None
        self._early: list[tuple] = []  # ticks before `attach` (none carry outputs)
        self._lock = threading.Lock()
        threading.Thread(target=self._send_loop, daemon=True, name="tokenweir-core-send").start()
        threading.Thread(target=self._receive_loop, daemon=True,
                         name="tokenweir-core-receive").start()

    @classmethod
    def start(cls, config, timeline_steps: int, log_level: str) -> "CoreClient":
        """Fork the engine core process (before this process starts threads of its own: the
        core inherits no lock held by one) and begin building its engine there."""
        import multiprocessing

        from tokenweir.engine.core_process import core_main

        context = multiprocessing.get_context("fork")
        here, there = context.Pipe()
        proc = context.Process(target=core_main, name="tokenweir-core", daemon=True,
                               args=(config, there, here, timeline_steps, log_level))
        proc.start()
        there.close()
        return cls(proc, here)

    # ---- out --------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """Queue a message to the core (any thread; never blocks)."""
        self._outbox.put(message)

    def call(self, name: str, timeout: float = 60.0) -> Any:
        """Ask the core a question (core_protocol.CALLS); its answer. Not on the receiver."""
        answer: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = answer
        self.send(("call", call_id, name))
        return answer.result(timeout)

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the core is gone: the receiver says so
                return

    # ---- in ---------------------------------------------------------------------------
    def wait_ready(self) -> ReadyInfo:
        """Once the core's engine is built: what it tells; raises what its build raised."""
        return self.ready.result()

    def attach(self, on_tick: Callable[[list, list], None],
               on_end: Callable[[Optional[str]], None]) -> Future:
        """Hand every tick (events, metrics) to `on_tick`, then the end to `on_end`, on the
        receiver thread; `ended`, the Future that says when it ended."""
        with self._lock:
            self._handlers = (on_tick, on_end)
            early, self._early = self._early, []
            for events, metrics in early:
                on_tick(events, metrics)
            if self.ended.done():
                on_end(self.ended.result())
        return self.ended

    def _receive_loop(self) -> None:
        reason: Optional[str] = None
        try:
            while self._take(self.conn.recv()):
                pass
        except (EOFError, OSError):
            reason = self._death()
        except Exception as exc:  # noqa: BLE001 - a message that cannot be read
            logger.exception("reading the engine core's messages failed")
            reason = f"the engine core's messages could not be read: {exc!r}"
        self._end(reason)

    def _take(self, message: tuple) -> bool:
        """Handle one message from the core; False at its last ("bye")."""
        kind = message[0]
        if kind == "tick":
            self._tick(message[1], message[2])
        elif kind == "ready":
            self.ready.set_result(message[1])
        elif kind == "error":
            self.ready.set_exception(error_from(message[1], message[2]))
        return kind != "bye"

    def _tick(self, events: list, metrics: list) -> None:
        rest = []
        for event in events:
            if event[0] == "reply":
                answer = self._calls.pop(event[1], None)
                if answer is not None:
                    answer.set_result(event[2])
            else:
                rest.append(event)
        with self._lock:
            if self._handlers is None:
                self._early.append((rest, metrics))
                return
        self._handlers[0](rest, metrics)

    def _death(self) -> str:
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        how = "is still running" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        return f"the engine core process (pid {self.pid}) {how}; the server cannot serve"

    def _end(self, reason: Optional[str]) -> None:
        if not self.ready.done():
            self.ready.set_exception(CoreDied(reason or "the engine core ended before ready"))
        for answer in list(self._calls.values()):
            if not answer.done():
                answer.set_exception(CoreDied(reason or "the engine core has shut down"))
        with self._lock:
            self.ended.set_result(reason)
            handlers = self._handlers
        if handlers is not None:
            handlers[1](reason)

    # ---- end --------------------------------------------------------------------------
    def close(self, timeout: float = EXIT_TIMEOUT) -> None:
        """After "shutdown" (or a death): wait for the process, terminate it if it lingers,
        and stop the sender."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine core process did not exit in %.0f s: terminating it",
                           timeout)
            self.proc.terminate()
            self.proc.join(5)
        self._outbox.put(None)
        self.conn.close()


def cached_tokenizer(model: str):
    """The model's tokenizer from the load cache entry the core maps (model/load_cache.py),
    or None when there is none to read (cold start, cache off, not a GGUF, a damaged entry:
    the core's build then decides, and `RemoteEngine` asks it)."""
    from tokenweir.model import load_cache
    from tokenweir.model.paths import resolve_model_path
    from tokenweir.model.tokenizer import Tokenizer

    try:
        path = resolve_model_path(model)
        if not (path.endswith(".gguf") and load_cache.cache_enabled()):
            return None
        root = load_cache.cache_root()
        sha = load_cache.known_digest(path, root)
        if sha is None:
            return None
        derivation = load_cache.derivation_tag()
        parts = load_cache.read_tokenizer(load_cache.entry_dir(root, sha, derivation), sha,
                                          derivation)
    except (OSError, ValueError, load_cache.CacheCorrupt):
        return None
    return None if parts is None else Tokenizer.from_cache(*parts)


class RemoteEngine(InputProcessor):
    """What AsyncEngine drives in the API process: the engine's input side (make_request,
    here), its output side (an OutputProcessor, here) and the core over a CoreClient.

    Contract: every request submitted has a copy here (`mirrors`, by scheduler id; a group's
    samples each), brought to the core's state by each step's records (`core_outputs`, on
    the output side) and dropped when it finishes or its output state is gone (`prune`)."""

    def __init__(self, client: CoreClient, info: ReadyInfo, tokenizer,
                 hopeless_tolerance: float = 0.0) -> None:
        self.client = client
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.tokenizer = tokenizer
        self.ttft_predictor = info.ttft_predictor
        self.hopeless_tolerance = hopeless_tolerance
        self.metrics = info.metrics
        self.outputs = OutputProcessor(tokenizer)
        self.mirrors: dict[str, Request] = {}
        self._ids = itertools.count()

    @classmethod
    def connect(cls, client: CoreClient, model: str, hopeless_tolerance: float = 0.0
                ) -> "RemoteEngine":
        """Wait for the core's ready; the tokenizer from the load cache when it is the core's
        (same EOS ids), else the core's own."""
        from tokenweir.model.tokenizer import Tokenizer

        tokenizer = cached_tokenizer(model)
        if tokenizer is not None and PRECOMPUTE_PROMPT_BOUND:
            from tokenweir.engine.async_engine import _longest_token_chars

            _longest_token_chars(tokenizer)  # AsyncEngine's prompt bound, while the core builds
        info = client.wait_ready()
        if tokenizer is not None and frozenset(tokenizer.eos_token_ids) != info.eos_token_ids:
            tokenizer = None
        if tokenizer is None and info.has_tokenizer:
            tokenizer = Tokenizer.from_cache(*client.call("tokenizer"))
        return cls(client, info, tokenizer, hopeless_tolerance)

    def submit_request(self, request: Request, prompt: Optional[str]) -> None:
        """LLMEngine.submit_request's counterpart: the output state here, the request there."""
        self.outputs.add_request(request, prompt)  # sets needs_token_outputs: before it is sent
        samples = [request] if request.group is None else request.group.samples
        self.mirrors.update((s.request_id, s) for s in samples)
        self.client.send(("add", request))

    def ttft_infeasible(self, request: Request) -> bool:
        """LLMEngine.ttft_infeasible with the predictor the core measured."""
        if self.ttft_predictor is None or request.ttft_slo_ms is None:
            return False
        from tokenweir.core.sched import slo

        return slo.infeasible_alone(self.ttft_predictor, request.num_prompt_tokens,
                                    request.ttft_slo_ms / 1000, self.hopeless_tolerance)

    def get_metrics(self) -> list:
        return self.metrics

    def core_outputs(self, records: list) -> list[EngineCoreOutput]:
        """One step's records as EngineCoreOutputs of the copies (output side only)."""
        outputs = []
        for record in records:
            mirror = self.mirrors.get(record[0])
            if mirror is None:  # ended here already (abort, stop string, error)
                continue
            outputs.append(apply_record(mirror, record))
            if record[3] is not None:
                del self.mirrors[record[0]]
        return outputs

    def prune(self) -> None:
        """Drop the copies whose output state is gone (after an abort or a failure)."""
        states = self.outputs.states
        gone = [k for k, r in self.mirrors.items() if OutputProcessor.output_id(r) not in states]
        for request_id in gone:
            self.mirrors.pop(request_id, None)

