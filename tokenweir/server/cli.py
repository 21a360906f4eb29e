"""What `tokenweir serve` runs: the server, from the parsed command line (tokenweir/cli
builds the parser from config.ServeConfig and the engine configs; this module never imports
it)."""

from __future__ import annotations

import argparse
import logging
import os

from tokenweir.config import DEFAULT_MODEL, engine_kwargs


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenweir.config import EngineConfig
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.server.app import ServerSettings, build_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    if args.model_tag:
        kwargs["model"] = args.model_tag
    kwargs.setdefault("model", DEFAULT_MODEL)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**kwargs)))
    names = tuple(args.served_model_name or ()) or (kwargs["model"],)
    if engine.model_name not in names:
        names = (*names, engine.model_name)
    settings = ServerSettings(
        served_model_names=names,
        api_key=args.api_key or os.environ.get("TOKENWEIR_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout)
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 5,
                            timeout_keep_alive=30, backlog=4096)
    _GracefulServer(config).run()  # SIGTERM: stop accepting, drain, lifespan shutdown
    return 0


def _graceful_server_class():
    import contextlib
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (the process then dies
        of the signal); here a signal only asks for shutdown, so the exit status is 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            def ask(sig, frame):
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
            previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _GracefulServer(config):
    return _graceful_server_class()(config)
