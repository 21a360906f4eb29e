"""AsyncEngine: the LLMEngine step loop on one background thread, streamed to asyncio.

Contract: a new request is validated and tokenized on a worker thread (`make_request`, which
reads only immutable engine state; the Rust tokenizer releases the GIL), never on the event
loop, and a text prompt too long to fit max_model_len by its length alone is refused before it
is tokenized at all. It is handed to the engine with `submit_request`, the
thread-safe inbox: a step in flight does not delay its arrival, so the SLO monitor can cut that
step for an urgent request. Every other LLMEngine call (abort_requests, step, get_metrics)
happens on the engine thread; other threads hand it aborts through `_aborts` (guarded by
`_cond`), and the engine thread admits submitted requests before it handles aborts, so an
abort always finds the request it names. Each request's delta outputs go to its own
asyncio.Queue on the event loop, delivered once per step with `loop.call_soon_threadsafe`.
When there is nothing to do the thread sleeps on the condition (no busy loop).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from tokenweir.engine.llm_engine import LLMEngine, PromptType
from tokenweir.engine.metrics import _HistogramData
from tokenweir.outputs import RequestOutput
from tokenweir.request import SamplingParams

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
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer  # read-only use (chat templates) is thread-safe
        self.stats = RequestStats()
        self.metrics_snapshot: list = engine.get_metrics()  # replaced by the engine thread
        self.stats_lock = threading.Lock()
        self._cond = threading.Condition()
        self._aborts: collections.deque[str] = collections.deque()  # request ids
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: dict[str, asyncio.Queue] = {}  # event-loop side only
        self._tracked: dict[str, _Tracked] = {}  # added on the event loop, then engine side
        self._unstarted: set[str] = set()  # event-loop side: admitted, no output yet
        self._tokenizing = 0  # event-loop side: requests in off_loop work (tokenizing)
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS,
                                              thread_name_prefix="tokenweir-tokenize")
        self.max_prompt_chars = self.max_model_len * 2 * _longest_token_chars(self.tokenizer)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenweir-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def num_active(self) -> int:
        return len(self._queues)

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
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()
        return len(request_ids)

    def shutdown(self) -> None:
        """Abort whatever is still running and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    # ---- public API (event loop) --------------------------------------------------------
    async def add(self, prompt: PromptType, params: SamplingParams, request_id: str,
                  priority: int = 0, ttft_slo_ms: Optional[float] = None) -> asyncio.Queue:
        """Validate and queue a request; ValueError (from make_request) if it is bad.
        Returns the queue its delta RequestOutputs arrive on (an Exception on engine error)."""
        if not self.is_running:
            raise EngineDeadError("the engine is shutting down")
        self.refuse_oversize(prompt)
        request, text = await self.off_loop(
            self.engine.make_request, prompt, params, request_id=request_id,
            priority=priority, ttft_slo_ms=ttft_slo_ms)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._unstarted.add(request_id)
        self._tracked[request_id] = _Tracked(ttft_slo_ms)
        with self._cond:
            if self._stopping:
                self._forget(request_id)
                raise EngineDeadError("the engine is shutting down")
            self.engine.submit_request(request, text)
            self._cond.notify()
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
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for unknown or finished requests."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- plumbing -----------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """Event-loop side: route one step's outputs to their queues."""
        for request_id, item in items:
            self._unstarted.discard(request_id)
            queue = self._queues.get(request_id)
            if queue is None:
                continue
            queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                self._queues.pop(request_id, None)

    def _post(self, items: list[tuple[str, Any]]) -> None:
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._aborts and not self._stopping and not \
                        engine.has_unfinished_requests():
                    self._cond.wait()
                aborts = list(self._aborts)
                self._aborts.clear()
                stopping = self._stopping
            engine.core.admit_submitted()
            items: list[tuple[str, Any]] = []
            for request_id in aborts:
                self._abort_one(request_id, items)
            if stopping:
                self._abort_all(items)
                self._post(items)
                self._refresh_metrics()
                return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step(delta=True)
                except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
                    logger.exception("engine step failed; aborting in-flight requests")
                    self._fail_all(exc, items)
                    outputs = []
                for out in outputs:
                    self._observe(out)
                    items.append((out.request_id, out))
            self._post(items)
            self._refresh_metrics()

    def _abort_one(self, request_id: str, items: list) -> None:
        engine = self.engine
        if request_id not in engine.outputs.states:
            return
        engine.abort_requests([request_id])
        final = engine.outputs.make_output(request_id, delta=True)
        engine.outputs.pop(request_id)
        self._tracked.pop(request_id, None)
        with self.stats_lock:
            self.stats.finished["abort"] += 1
        items.append((request_id, final))

    def _abort_all(self, items: list) -> None:
        for request_id in list(self.engine.outputs.states):
            self._abort_one(request_id, items)

    def _fail_all(self, exc: Exception, items: list) -> None:
        error = RuntimeError(f"engine error: {exc}")
        for request_id in list(self.engine.outputs.states):
            try:
                self.engine.abort_requests([request_id])
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step failed")
            self.engine.outputs.pop(request_id)
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

    def _refresh_metrics(self) -> None:
        try:
            self.metrics_snapshot = self.engine.get_metrics()
        except Exception:  # noqa: BLE001
            logger.exception("metrics snapshot failed")


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest vocabulary entry (at least 16): a bound on how much text one
    token can cover, for refusing absurd prompts before tokenizing them."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(16, max(len(token) for token in vocab))
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary
        return 256
