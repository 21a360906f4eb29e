"""The ASGI app uvicorn serves while the engine core process is still building
(`tokenweir serve --engine-process`, server/cli.py): the API process listens as soon as its own
imports are done, not after the core's "ready" (the core's torch import and engine build are
the start's critical path; uvicorn's start then runs beside them, not after).
Measured (benchmarks/startup.py --timeline, warm serve, exclusive, 2-vCPU AVX2, 3 rounds):
from the core's "ready" to /health 200, 0.13-0.15 s before (AsyncEngine ~0.07-0.09 s of it,
then create_app and uvicorn's start) and 0.02-0.04 s with this gate and the prompt bound
computed before "ready" (engine/core_client.py, RemoteEngine.connect).

Contract: until `open` has run the real app's (server/app.py) lifespan start, every HTTP
request is answered 503 "service_unavailable" with the API's error shape and a Retry-After,
GET /health included: /health never answers 200 before the engine runs. After it, every
request is the real app's. `fail(exc)` (the start failed) asks the server to exit; the caller
reads `failure` afterwards. The lifespan's end runs the real app's (the drain) when it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Optional

from tokenweir.server import protocol as P
from tokenweir.server.errors import error_response

STARTING = "the engine is starting; retry shortly"


class StartGate:
    def __init__(self) -> None:
        self.app: Any = None  # the real app, once its lifespan has started
        self.failure: Optional[BaseException] = None
        self.server: Any = None  # the uvicorn.Server to stop on a failure
        self._pending: Any = None  # the real app, built, not yet opened
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._lock = threading.Lock()
        self._stack = contextlib.AsyncExitStack()
        self._closed = False  # the lifespan has ended: nothing opens after

    def state(self):
        """The real app's AppState, or None before it opened."""
        return None if self.app is None else self.app.state.tokenweir

    # ---- from the thread that builds the real app ---------------------------------------
    def hand_over(self, app: Any) -> None:
        """The real app is built: open it on the event loop (now, or when the loop starts)."""
        with self._lock:
            self._pending = app
            loop = self._loop
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._open(), loop)
            except RuntimeError:  # the loop closed meanwhile: the server has stopped
                pass

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        if self.server is not None:
            self.server.should_exit = True

    # ---- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            err = P.APIError(STARTING, 503, "service_unavailable", headers={"Retry-After": "1"})
            await error_response(err)(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        await receive()  # lifespan.startup
        with self._lock:
            self._loop = asyncio.get_running_loop()
        await self._open()  # the real app, if it was built before the loop started
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        self._closed = True
        await self._stack.aclose()  # the real app's lifespan end, if it started
        await send({"type": "lifespan.shutdown.complete"})

    async def _open(self) -> None:
        """On the loop: start the real app's lifespan (the engine), then let requests in.
        Once: whoever takes the pending app opens it; never after the lifespan ended."""
        with self._lock:
            app, self._pending = self._pending, None
        if app is None or self._closed:
            return
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        self.app = app
