"""What `tokenweir serve` runs: the server, from the parsed command line (tokenweir/cli
builds the parser from config.ServeConfig and the engine configs; this module never imports
it). The engine runs in this process on its engine thread, or with --engine-process in a
process of its own (engine/core_client.py), forked before anything else starts; the server
then listens while that process builds, answering 503 until it is ready (server/gate.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from tokenweir.config import DEFAULT_MODEL, engine_kwargs


def run_serve(args: argparse.Namespace) -> int:
    from tokenweir import startup_gc

    checked = _checked_config(args)
    if isinstance(checked, int):
        return checked
    config, model = checked
    if args.engine_process and not args.profile_serving:
        from tokenweir.engine.core_client import CoreClient

        client = CoreClient.start(config, args.timeline_steps, args.log_level)
        return _serve_front(args, config, model, client)
    with startup_gc.paused():  # imports and the build: no collector passes (startup_gc.py)
        started = _start(args, config, model)
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
    # the load cache checked while torch imports
    prefetch.start_for_model(model, config.model.dtype, config.model.device)
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


def _serve_front(args: argparse.Namespace, config, model: str, client) -> int:
    """Serve with the engine core in its own process (already building): the server stack
    is imported and uvicorn listens meanwhile, behind a StartGate (server/gate.py: 503 until
    the core is ready); a thread waits for the core's "ready", builds the app and opens the
    gate. Returns the exit status (a refusal's when the core's build refused)."""
    from tokenweir import startup_gc
    from tokenweir.usage_errors import refuse

    _log_config(args)
    with startup_gc.paused():  # the imports: no collector passes (startup_gc.py)
        from tokenweir.server.gate import StartGate
        from tokenweir.server.serve import make_server

        gate = StartGate()
        gate.server = make_server(gate, gate.state, args.host, args.port, args.log_level)
    threading.Thread(target=_open_when_ready, args=(args, config, model, client, gate),
                     daemon=True, name="tokenweir-connect").start()
    gate.server.run()
    failure = gate.failure  # read before the kill below (whose CoreDied is no failure)
    if gate.app is None:  # stopped (or failed) before ready: the core holds nothing to drain
        client.proc.kill()
        client.close()
    if isinstance(failure, ValueError):  # what only the load can tell (e.g. a pool size)
        return refuse("serve", failure)
    if failure is not None:
        raise failure
    return 0


def _open_when_ready(args: argparse.Namespace, config, model: str, client, gate) -> None:
    """The gate's thread: the tokenizer here while the core builds, then (its "ready") the
    AsyncEngine over a RemoteEngine and the app, handed to the gate; a failure to the gate."""
    from tokenweir import startup_gc

    try:
        with startup_gc.paused():
            from tokenweir.engine.async_engine import AsyncEngine
            from tokenweir.engine.core_client import RemoteEngine
            from tokenweir.engine.core_side import RemoteCore
            from tokenweir.server.app import create_app

            remote = RemoteEngine.connect(client, model,
                                          config.scheduler.slo_hopeless_tolerance)
            # No torch threads here: outputs are processed on the client's receiver thread
            # unless asked for a thread of their own ("on").
            output_thread = args.output_thread == "on"
            _log_outputs(output_thread, args.output_thread)
            engine = AsyncEngine(remote, output_thread=output_thread, core=RemoteCore(remote))
            logging.getLogger(__name__).info("engine core in process %d", client.pid)
            app = create_app(engine, _settings(args, model, engine))
    except BaseException as exc:  # noqa: BLE001 - the main thread refuses or re-raises it
        gate.fail(exc)
        return
    gate.hand_over(app)


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
