"""What `tokenweir router` runs (tokenweir/cli builds the parser from config.RouterConfig; this
module never imports it)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
from typing import Iterator

from tokenweir.config import RouterConfig


def router_config(args: argparse.Namespace, **override) -> RouterConfig:
    """The RouterConfig a parsed command line names ($TOKENWEIR_API_KEY stands in for a
    missing --api-key)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)
              if hasattr(args, f.name)}
    values["replicas"] = tuple(values.get("replicas") or ())
    values["api_key"] = values.get("api_key") or os.environ.get("TOKENWEIR_API_KEY") or None
    values.update(override)
    return RouterConfig(**values)


def run_router(args: argparse.Namespace) -> int:
    config = router_config(args)
    if not config.replicas:
        raise SystemExit("tokenweir router: give at least one --replica URL")
    return serve_router(config)


def serve_router(config: RouterConfig) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    from tokenweir.router.app import create_router_app

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    app = create_router_app(config)
    server_config = uvicorn.Config(app, host=config.host, port=config.port,
                                   log_level=config.log_level, timeout_keep_alive=30,
                                   backlog=4096)
    _server_class(uvicorn)(server_config).run()
    return 0


def _server_class(uvicorn):
    class RouterServer(uvicorn.Server):
        """Unlike uvicorn's, re-raises no signal after shutting down: a signal asks for
        shutdown (exit status 0), and `tokenweir serve --data-parallel-size` still has its
        replicas to stop when this returns."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    return RouterServer
