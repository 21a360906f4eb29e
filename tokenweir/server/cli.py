"""What `tokenweir serve` runs: the server, from the parsed command line (tokenweir/cli
builds the parser from config.ServeConfig and the engine configs; this module never imports
it)."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenweir.config import DEFAULT_MODEL, engine_kwargs


def run_serve(args: argparse.Namespace) -> int:
    from tokenweir import startup_gc

    with startup_gc.paused():  # imports and the build: no collector passes (startup_gc.py)
        started = _start(args)
    if isinstance(started, int):
        return started
    engine, settings, profile = started
    from tokenweir.server.serve import serve

    status = serve(engine, settings, args.host, args.port, args.log_level)
    if profile is not None:
        from tokenweir.engine.serving_profile import format_profile

        print(format_profile(profile.snapshot()), file=sys.stderr, flush=True)
    return status


def _start(args: argparse.Namespace):
    """(AsyncEngine, ServerSettings, ServingProfile or None), or a refusal's exit status."""
    from tokenweir.usage_errors import refuse
    from tokenweir.config import EngineConfig
    from tokenweir.engine.preflight import check_before_load

    kwargs = engine_kwargs(args)
    if args.model_tag:
        kwargs["model"] = args.model_tag
    kwargs.setdefault("model", DEFAULT_MODEL)
    try:  # refused in one line before torch, the server or the model load
        config = EngineConfig.from_kwargs(**kwargs)
        check_before_load(config)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return refuse("serve", exc)
    from tokenweir.model import prefetch
    prefetch.start_for_model(kwargs["model"])  # the load cache checked while torch imports
    from tokenweir.engine.engine_thread import EngineThread, wants_output_thread
    from tokenweir.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_thread = EngineThread()  # builds the engine, then steps it: one thread for torch
    building = engine_thread.submit(lambda: LLMEngine(config))
    # The server's imports (fastapi, pydantic, uvicorn: ~0.5-1 s) run meanwhile, on this thread
    # while the engine thread sits in torch calls that release the GIL.
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.serving_profile import ServingProfile
    import tokenweir.server.serve  # noqa: F401 (the server stack, imported meanwhile)
    from tokenweir.server.settings import ServerSettings

    profile = ServingProfile() if args.profile_serving else None
    try:
        llm_engine = building.result()
    except ValueError as exc:  # what only the load can tell (e.g. a --kv-cache-space pool)
        engine_thread.stop()
        return refuse("serve", exc)
    output_thread = wants_output_thread(args.output_thread, engine_thread)
    logging.getLogger(__name__).info(
        "outputs processed on %s (--output-thread %s)",
        "a thread of their own" if output_thread else "the engine thread", args.output_thread)
    engine = AsyncEngine(llm_engine, output_thread=output_thread, profile=profile,
                         engine_thread=engine_thread)
    names = tuple(args.served_model_name or ()) or (kwargs["model"],)
    if engine.model_name not in names:
        names = (*names, engine.model_name)
    return engine, ServerSettings.from_serve_args(args, names), profile
