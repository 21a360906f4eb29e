"""What `tokenweir serve` runs: the server, from the parsed command line (tokenweir/cli
builds the parser from config.ServeConfig and the engine configs; this module never imports
it). The engine runs in this process on its engine thread, or with --engine-process in a
process of its own (engine/core_client.py), forked before anything else starts."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenweir.config import DEFAULT_MODEL, engine_kwargs


def run_serve(args: argparse.Namespace) -> int:
    from tokenweir import startup_gc

    checked = _checked_config(args)
    if isinstance(checked, int):
        return checked
    config, model = checked
    client = None
    if args.engine_process and not args.profile_serving:
        from tokenweir.engine.core_client import CoreClient

        client = CoreClient.start(config, args.timeline_steps, args.log_level)
    with startup_gc.paused():  # imports and the build: no collector passes (startup_gc.py)
        started = _start(args, config, model) if client is None else \
            _start_front(args, config, model, client)
    if isinstance(started, int):
        return started
    engine, settings, profile = started
    from tokenweir.server.serve import serve

    status = serve(engine, settings, args.host, args.port, args.log_level)
    if profile is not None:
        from tokenweir.engine.serving_profile import format_profile

        print(format_profile(profile.snapshot()), file=sys.stderr, flush=True)
    return status


def _checked_config(args: argparse.Namespace):
    """(EngineConfig, model argument), or a refusal's exit status: refused in one line before
    torch, the server or the model load."""
    from tokenweir.usage_errors import refuse
    from tokenweir.config import EngineConfig
    from tokenweir.engine.preflight import check_before_load

    kwargs = engine_kwargs(args)
    if args.model_tag:
        kwargs["model"] = args.model_tag
    kwargs.setdefault("model", DEFAULT_MODEL)
    try:
        config = EngineConfig.from_kwargs(**kwargs)
        check_before_load(config)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return refuse("serve", exc)
    return config, kwargs["model"]


def _start(args: argparse.Namespace, config, model: str):
    """(AsyncEngine, ServerSettings, ServingProfile or None), or a refusal's exit status."""
    from tokenweir.usage_errors import refuse
    from tokenweir.model import prefetch
    prefetch.start_for_model(model)  # the load cache checked while torch imports
    from tokenweir.engine.engine_thread import EngineThread, wants_output_thread
    from tokenweir.engine.llm_engine import LLMEngine

    _log_config(args)
    engine_thread = EngineThread()  # builds the engine, then steps it: one thread for torch
    building = engine_thread.submit(lambda: LLMEngine(config))
    # The server's imports (fastapi, pydantic, uvicorn: ~0.5-1 s) run meanwhile, on this thread
    # while the engine thread sits in torch calls that release the GIL.
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.serving_profile import ServingProfile
    import tokenweir.server.serve  # noqa: F401 (the server stack, imported meanwhile)

    profile = ServingProfile() if args.profile_serving else None
    try:
        llm_engine = building.result()
    except ValueError as exc:  # what only the load can tell (e.g. a --kv-cache-space pool)
        engine_thread.stop()
        return refuse("serve", exc)
    output_thread = wants_output_thread(args.output_thread, engine_thread)
    _log_outputs(output_thread, args.output_thread)
    engine = AsyncEngine(llm_engine, output_thread=output_thread, profile=profile,
                         engine_thread=engine_thread)
    return engine, _settings(args, model, engine), profile


def _start_front(args: argparse.Namespace, config, model: str, client):
    """_start's counterpart with the engine core in its own process (already building): the
    server stack and the tokenizer here meanwhile, then wait for its "ready"."""
    from tokenweir.usage_errors import refuse

    _log_config(args)
    import tokenweir.server.serve  # noqa: F401 (the server stack, imported meanwhile)
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.core_client import RemoteEngine

    try:
        remote = RemoteEngine.connect(client, model,
                                      config.scheduler.slo_hopeless_tolerance)
    except ValueError as exc:  # what only the load can tell (e.g. a --kv-cache-space pool)
        client.close()
        return refuse("serve", exc)
    # No torch threads here: outputs are processed on the client's receiver thread unless
    # asked for a thread of their own ("on").
    output_thread = args.output_thread == "on"
    _log_outputs(output_thread, args.output_thread)
    engine = AsyncEngine(remote, output_thread=output_thread)
    logging.getLogger(__name__).info("engine core in process %d", client.pid)
    return engine, _settings(args, model, engine), None


def _log_config(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _log_outputs(output_thread: bool, mode: str) -> None:
    logging.getLogger(__name__).info(
        "outputs processed on %s (--output-thread %s)",
        "a thread of their own" if output_thread else "the engine thread", mode)


def _settings(args: argparse.Namespace, model: str, engine):
    from tokenweir.server.settings import ServerSettings

    names = tuple(args.served_model_name or ()) or (model,)
    if engine.model_name not in names:
        names = (*names, engine.model_name)
    return ServerSettings.from_serve_args(args, names)
