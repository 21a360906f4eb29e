"""AsyncEngine: the LLMEngine step loop on one background thread, streamed to asyncio.

Contract: a new request is validated and tokenized on a worker thread (`make_request`, which
reads only immutable engine state; the Rust tokenizer releases the GIL), never on the event
loop, and a text prompt too long to fit max_model_len by its length alone is refused before it
is tokenized at all. It is handed to the engine with `submit_request`, the
thread-safe inbox: a step in flight does not delay its arrival, so the SLO monitor can cut that
step for an urgent request.

Three threads share the work of a served token:
- the engine thread owns the scheduler (every EngineCore call: admission, aborts, steps): the
  core's side (engine/core_side.py), one interface with two implementations: `LocalCore`, an
  EngineThread of this process (in a server it also built the engine, so that every torch
  computation runs on this one thread; see engine_thread.py), or `RemoteCore`, the engine core
  process of `serve --engine-process` (its CoreClient's receiver thread stands for the engine
  thread here). It goes from one step's update straight to the next schedule: it hands each
  step's raw engine-core outputs to the output side and never waits on detokenization, the
  event loop or a socket. It admits submitted requests before it handles aborts, so an abort
  always finds the request it names.
- the output thread (`output_thread=True`, the default) owns the output processor after
  admission: incremental detokenization, stop strings, building RequestOutputs, latency stats.
  A stop string (or a failure while processing) ends the request on the output side at once;
  the engine thread is asked (the side's `finish`) to finish it in the scheduler at its next
  turn, so the engine may compute one more token for it, which is dropped (vLLM does the same).
- the event loop: each request's delta outputs go to its own asyncio.Queue, delivered once per
  step with `loop.call_soon_threadsafe`.
With `output_thread=False` the output side runs inline on the engine thread (the old path, kept
for comparison). When there is nothing to do the engine thread sleeps (no busy loop). With a
`ServingProfile` every phase of this path is timed (tokenweir serve --profile-serving; see
engine/serving_profile.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue as queue_module
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from tokenweir.engine.core_side import LocalCore
from tokenweir.engine.engine_thread import EngineThread
from tokenweir.engine.metrics import _HistogramData
from tokenweir.engine.output_processor import OutputProcessor
from tokenweir.engine.serving_profile import ServingProfile
from tokenweir.outputs import RequestOutput
from tokenweir.request import Request, RequestStatus, SamplingParams

if TYPE_CHECKING:  # torch: the API process of `serve --engine-process` never imports it
    from tokenweir.engine.llm_engine import LLMEngine, PromptType

logger = logging.getLogger("tokenweir")

# Bucket bounds as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# Threads that tokenize prompts and render chat templates, off the event loop.
TOKENIZER_THREADS = 4


class EngineDeadError(RuntimeError):
    """The engine thread is gone (shut down); no new requests are taken."""


class HopelessRequestError(RuntimeError):
    """`add(..., reject_hopeless=True)`: the request's TTFT target cannot be met even alone
    (LLMEngine.ttft_infeasible); nothing was queued."""


@dataclass
class RequestStats:
    """Per-request latency histograms and finish counts, filled on the engine thread."""

    ttft: _HistogramData = field(default_factory=lambda: _HistogramData(TTFT_BUCKETS))
    itl: _HistogramData = field(default_factory=lambda: _HistogramData(ITL_BUCKETS))
    e2e: _HistogramData = field(default_factory=lambda: _HistogramData(REQUEST_BUCKETS))
    queue: _HistogramData = field(default_factory=lambda: _HistogramData(REQUEST_BUCKETS))
    finished: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class _Tracked:
    ttft_slo_ms: Optional[float]
    last_token_time: Optional[float] = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, output_thread: bool = True,
                 profile: Optional[ServingProfile] = None,
                 engine_thread: Optional[EngineThread] = None, core: Any = None) -> None:
        """`output_thread`: process outputs on their own thread (else inline on the engine
        thread); `profile`: time every phase of the serving path into it; `engine_thread`:
        the thread that built `engine` (EngineThread.call), on which the loop then runs (one
        thread for all torch work: see engine_thread.py); default: a new one.
        `core`: the core's side (engine/core_side.py); default a LocalCore over `engine` (an
        LLMEngine) on `engine_thread`. With a RemoteEngine (engine/core_client.py), its
        RemoteCore: the engine core then runs in a process of its own."""
        self.engine = engine
        self.death: Optional[str] = None  # why the engine core process died, if it did
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer  # read-only use (chat templates) is thread-safe
        self.stats = RequestStats()
        self.metrics_snapshot: list = engine.get_metrics()  # replaced by the engine thread
        self.stats_lock = threading.Lock()
        self._outbox: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._output_thread: Optional[threading.Thread] = None
        if output_thread:
            self._output_thread = threading.Thread(target=self._output_loop, daemon=True,
                                                   name="tokenweir-output")
        self.profile = profile
        if profile is not None:
            profile.attach(engine.core)
        self._posted_at: dict[str, float] = {}  # event loop, profiling: request -> last post
        self._side = core if core is not None else LocalCore(engine, engine_thread)
        self._running: Optional[Future] = None  # the engine loop, once started
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: dict[str, asyncio.Queue] = {}  # event-loop side only
        self._tracked: dict[str, _Tracked] = {}  # added on the event loop, then engine side
        # A parallel-sampling request's output id -> its samples' ids in the scheduler.
        self._sample_ids: dict[str, list[str]] = {}
        self._unstarted: set[str] = set()  # event-loop side: admitted, no output yet
        self._tokenizing = 0  # event-loop side: requests in off_loop work (tokenizing)
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS,
                                              thread_name_prefix="tokenweir-tokenize")
        self.max_prompt_chars = self.max_model_len * 2 * _longest_token_chars(self.tokenizer)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        if self._output_thread is not None:
            self._output_thread.start()
        self._running = self._side.start(self)

    @property
    def is_running(self) -> bool:
        return self._running is not None and not self._running.done() and \
            not self._side.stopping

    def num_active(self) -> int:
        return len(self._queues)

    def step_ring(self, capacity: int):
        """Where GET /timeline reads the last `capacity` steps' records (the core's side
        records them: engine/core_side.py); call before `start`."""
        return self._side.step_ring(capacity)

    async def drain(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) for in-flight requests to finish; True if they all did."""
        deadline = time.monotonic() + timeout
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._queues

    def abort_all(self) -> int:
        """Event loop: ask the engine thread to end every in-flight request; each one's queue
        then gets a final output with finish_reason 'abort'. Returns how many were asked."""
        request_ids = list(self._queues)
        self._side.abort([(request_id, self._scheduler_ids(request_id))
                          for request_id in request_ids])
        return len(request_ids)

    def shutdown(self) -> None:
        """Abort whatever is still running and stop the thread."""
        self._side.stop()
        if self._running is not None:
            futures_wait([self._running], timeout=30)
        self._side.close()
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    # ---- public API (event loop) --------------------------------------------------------
    async def add(self, prompt: PromptType, params: SamplingParams, request_id: str,
                  priority: int = 0, ttft_slo_ms: Optional[float] = None,
                  reject_hopeless: bool = False,
                  tpot_slo_ms: Optional[float] = None) -> asyncio.Queue:
        """Validate and queue a request; ValueError (from make_request) if it is bad,
        HopelessRequestError if `reject_hopeless` and its TTFT target cannot be met even alone.
        Returns the queue its delta RequestOutputs arrive on (an Exception on engine error)."""
        if not self.is_running:
            raise EngineDeadError("the engine is shutting down")
        self.refuse_oversize(prompt)
        request, text = await self.off_loop(
            self.engine.make_request, prompt, params, request_id=request_id,
            priority=priority, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
        if reject_hopeless and self.engine.ttft_infeasible(request):
            raise HopelessRequestError(
                f"ttft_slo_ms={ttft_slo_ms:g} cannot be met even with the server idle (a "
                f"{request.num_prompt_tokens}-token prompt); retry with a longer ttft_slo_ms "
                f"or none, or at another replica")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._unstarted.add(request_id)
        self._tracked[request_id] = _Tracked(ttft_slo_ms)
        if request.group is not None:  # n / best_of: an abort must reach every sample
            self._sample_ids[request_id] = [s.request_id for s in request.group.samples]
        if not self._side.submit(request, text):
            self._forget(request_id)
            raise EngineDeadError("the engine is shutting down")
        return queue

    def refuse_oversize(self, prompt: PromptType) -> None:
        """ValueError for a text prompt so long that it cannot fit max_model_len whatever its
        tokens (no token spans more than half of `max_prompt_chars / max_model_len`
        characters), without tokenizing it."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and len(text) > self.max_prompt_chars:
            raise ValueError(f"the prompt has {len(text)} characters: more tokens than "
                             f"max_model_len ({self.max_model_len}) allows")

    async def off_loop(self, fn, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on a tokenizer thread (CPU-heavy work the loop must not do).
        Meanwhile the request counts as waiting (`num_unstarted`), for admission control."""
        loop = asyncio.get_running_loop()
        self._tokenizing += 1
        try:
            return await loop.run_in_executor(self._tokenizers, lambda: fn(*args, **kwargs))
        finally:
            self._tokenizing -= 1

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          **template_kwargs: Any) -> str:
        """The chat template applied off the event loop (`template_kwargs`, e.g. tools, go to
        it); ValueError if it fails."""
        total = sum(len(m["content"]) for m in messages)
        if total > self.max_prompt_chars:
            raise ValueError(f"the messages have {total} characters: more tokens than "
                             f"max_model_len ({self.max_model_len}) allows")
        try:
            return await self.off_loop(self.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt,
                                       **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's
            raise ValueError(f"cannot apply the chat template: {exc}") from exc

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._sample_ids.pop(request_id, None)
        self._unstarted.discard(request_id)
        self._tracked.pop(request_id, None)

    @property
    def num_unstarted(self) -> int:
        """Requests admitted that have produced no token yet (being tokenized included): the
        waiting queue."""
        return len(self._unstarted) + self._tokenizing

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, ttft_slo_ms: Optional[float] = None
                       ) -> AsyncIterator[RequestOutput]:
        queue = await self.add(prompt, params, request_id, priority, ttft_slo_ms)
        async for out in self.stream(request_id, queue):
            yield out

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Delta outputs until the finished one. Leaving early (cancel, disconnect, break)
        aborts the request so its KV blocks go back to the pool."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._posted_at.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for unknown or finished requests."""
        self._side.abort([(request_id, self._scheduler_ids(request_id))])

    def _scheduler_ids(self, request_id: str) -> list[str]:
        """The scheduler's ids of a request: its samples' (n / best_of), else its own."""
        return self._sample_ids.get(request_id, [request_id])

    # ---- plumbing (event loop side) ------------------------------------------------------

    def _deliver(self, items: list[tuple[str, Any]], posted: float) -> None:
        """Event-loop side: route one step's outputs to their queues."""
        profile = self.profile
        if profile is not None:
            start = time.perf_counter()
            profile.wait("loop wait", start - posted)
        for request_id, item in items:
            self._unstarted.discard(request_id)
            queue = self._queues.get(request_id)
            if queue is None:
                continue
            queue.put_nowait(item)
            if profile is not None:
                self._posted_at[request_id] = posted
            if isinstance(item, BaseException) or item.finished:
                self._queues.pop(request_id, None)
        if profile is not None:
            profile.add("loop delivery", time.perf_counter() - start)

    def note_written(self, request_id: str, started: float) -> None:
        """Event loop, profiling only: a chunk of `request_id` went to the socket; its
        serialization and write began at `started` (perf_counter)."""
        if self.profile is None:
            return
        now = time.perf_counter()
        self.profile.add("SSE writing", now - started)
        posted = self._posted_at.get(request_id)
        if posted is not None:
            self.profile.wait("token -> wire", now - posted)

    def _post(self, items: list[tuple[str, Any]]) -> None:
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items, time.perf_counter())
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    # ---- from the core's side (engine/core_side.py) ----------------------------------------
    # The side hands the output side every message in the order the engine made them, so a
    # request's outputs, its abort and its failure arrive in that order; the output side asks
    # back (`_ask_engine`) when a stop string or a processing error ends a request.

    def to_output(self, message: tuple[str, Any]) -> None:
        """Hand a message to the output side: the output thread's inbox, or (without one)
        handle it here and now (an exception then reaches the caller)."""
        if self._output_thread is None:
            self._handle(message)
            return
        started = time.perf_counter()
        self._outbox.put(message)
        if self.profile is not None:
            self.profile.add("handoff", time.perf_counter() - started)

    def core_ended(self, reason: Optional[str]) -> None:
        """The core's side has ended, last: after a stop (reason None), or its process died
        (reason: why; every request in flight fails, no new one is taken)."""
        if reason is not None:
            logger.error("%s", reason)
            self.death = reason
            self._side.stop()
            self.to_output_guarded(("died", reason))
        if self._output_thread is not None:
            self._outbox.put(None)
            self._output_thread.join(timeout=30)

    def to_output_guarded(self, message: tuple[str, Any]) -> None:
        """`to_output`, logging an exception instead of raising it (for a receiver thread that
        must outlive one bad message)."""
        try:
            self.to_output(message)
        except Exception:  # noqa: BLE001 - the receiver must outlive one bad message
            logger.exception("output processing failed for %s", message[0])

    # ---- output side (the output thread, or the engine thread without one) -----------------
    # Owns the output processor (detokenizers, stop strings, texts) after admission and the
    # latency statistics; talks to the event loop with `_post` and to the engine thread with
    # `_ask_engine`.

    def _output_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - the output side must outlive one bad message
                logger.exception("output processing failed for %s", message[0])

    def _handle(self, message: tuple[str, Any]) -> None:
        kind, payload = message
        items: list[tuple[str, Any]] = []
        started = time.perf_counter()
        if kind == "step":
            self._process_step(*payload, items)
        elif kind == "records":  # a step of the core process (core_client.RemoteEngine)
            records, now = payload
            self._process_step(self.engine.core_outputs(records), now, items)
        elif kind == "abort":
            self._abort_one(payload, items)
        elif kind == "abort_all":
            for request_id in list(self.engine.outputs.states):
                self._abort_one(request_id, items)
        elif kind == "fail":
            self._fail(*payload, items)
        elif kind == "died":  # the core process is gone: every request in flight fails
            self._fail(list(self.engine.outputs.states), EngineDeadError(payload), items)
        if kind not in ("step", "records"):  # output states may have gone without a record
            self._side.outputs_dropped()
        posting = time.perf_counter()
        self._post(items)
        if self.profile is not None:
            self.profile.add("output processing", posting - started)
            self.profile.add("handoff", time.perf_counter() - posting)

    def _process_step(self, core_outputs: list, now: float, items: list) -> None:
        """One step's engine-core outputs -> delta RequestOutputs, one per request or
        parallel-sampling group (OutputProcessor.fold_step). A stop string or a processing
        failure ends its request here at once; the engine thread is asked to finish it in the
        scheduler at its next turn."""
        made = self.engine.outputs.fold_step(
            core_outputs, now, delta=True, on_stop=self._ask_engine_to_stop,
            on_fail=self._ask_engine_to_fail, yield_gil=self._output_thread is not None)
        for output_id, out in made.items():
            self._observe(out)
            items.append((output_id, out))
        if self.profile is not None:
            self.profile.count_step(sum(len(o.new_token_ids) for o in core_outputs))

    def _ask_engine_to_stop(self, request: Request) -> None:
        self._ask_engine(request.request_id, "")

    def _ask_engine_to_fail(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            self._ask_engine(request_id, message)

    def _ask_engine(self, request_id: str, message: str) -> None:
        """Finish `request_id` in the scheduler at the engine thread's next turn: stopped
        (message "") or failed with `message`."""
        self._side.finish(request_id, message)

    def _abort_one(self, request_id: str, items: list) -> None:
        final = self.engine.outputs.abort(request_id, delta=True)
        if final is None:
            return
        self._tracked.pop(request_id, None)
        with self.stats_lock:
            self.stats.finished["abort"] += 1
        items.append((request_id, final))

    def _fail(self, request_ids: list[str], exc: Exception, items: list) -> None:
        error = RuntimeError(f"engine error: {exc}")
        for request_id in request_ids:
            if self.engine.outputs.states.pop(request_id, None) is None:
                continue
            self._tracked.pop(request_id, None)
            with self.stats_lock:
                self.stats.finished["error"] += 1
            items.append((request_id, error))

    def _observe(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        m = out.metrics
        now = m.last_token_time
        with self.stats_lock:
            if tracked.last_token_time is None:
                if m.first_token_time is not None:
                    self.stats.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.stats.queue.observe(m.first_scheduled_time - m.arrival_time)
            elif now is not None:
                n = max(1, len(out.outputs[0].token_ids))
                gap = (now - tracked.last_token_time) / n
                for _ in range(n):
                    self.stats.itl.observe(gap)
            tracked.last_token_time = now
            if out.finished:
                end = m.finished_time or now or m.arrival_time
                self.stats.e2e.observe(end - m.arrival_time)
                self.stats.finished[out.outputs[0].finish_reason or "stop"] += 1
        if out.finished:
            self._tracked.pop(out.request_id, None)


# tokenizer -> _longest_token_chars: listing a 49k vocabulary takes ~0.05-0.09 s, which the
# engine-process front pays while the core builds (engine/core_client.py, RemoteEngine.connect),
# not after its "ready".
_LONGEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest vocabulary entry (at least 16): a bound on how much text one
    token can cover, for refusing absurd prompts before tokenizing them. Remembered per
    tokenizer object."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):  # not yet, or not weakly referable (None)
        pass
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        longest = max(16, max(len(token) for token in vocab))
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary
        return 256
    _LONGEST[tokenizer] = longest
    return longest
