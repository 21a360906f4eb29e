"""Running the app under uvicorn, with tokenweir's shutdown rules.

First SIGTERM or SIGINT: stop accepting connections, let in-flight requests run for up to
`drain_timeout` seconds, end the rest with finish_reason 'abort' (each open stream gets its
final chunk and `[DONE]`), then stop the engine; the process exits 0. A second signal during
that drain exits at once with a message and status 128 + the signal number, without running
interpreter teardown while the engine thread may be inside a torch call (that teardown is
what used to abort with 'terminate called without an active exception').
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Callable, Iterator, Optional

import uvicorn

from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.server.app import create_app
from tokenweir.server.settings import ServerSettings
from tokenweir.server.state import AppState

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds uvicorn waits for connections after the drain has ended every request.
FLUSH_TIMEOUT = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state_of: Callable[[], Optional[AppState]]
                 ) -> None:
        """`state_of`: the app's AppState, or None while there is none yet (a StartGate's
        app before the engine core is ready: nothing to drain)."""
        super().__init__(config)
        self.state_of = state_of

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Unlike uvicorn's, re-raises no signal afterwards: a signal asks for shutdown, it
        is not the cause of death (exit status 0)."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.should_exit:
            state = self.state_of()
            exit_now(sig, 0 if state is None else state.engine.num_active())
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting before the drain, not after
            server.close()
        state = self.state_of()
        if state is not None:
            await state.drain()
        await super().shutdown(sockets)


def exit_now(sig: int, num_active: int) -> None:
    """The second signal: say so and leave without teardown."""
    name = signal.Signals(sig).name
    sys.stderr.write(f"tokenweir: second {name} during shutdown: exiting now, "
                     f"{num_active} request(s) cut without an answer\n")
    sys.stderr.flush()
    os._exit(128 + sig)


def serve(engine: AsyncEngine, settings: ServerSettings, host: str, port: int,
          log_level: str = "info") -> int:
    """Serve until a signal; returns the process exit status."""
    app = create_app(engine, settings)
    make_server(app, lambda: app.state.tokenweir, host, port, log_level).run()
    return 0


def make_server(app: Any, state_of: Callable[[], Optional[AppState]], host: str, port: int,
                log_level: str = "info") -> DrainingServer:
    """The uvicorn server of `app` (a FastAPI app, or a StartGate in front of one)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT, timeout_keep_alive=30,
                            backlog=4096)
    return DrainingServer(config, state_of)
