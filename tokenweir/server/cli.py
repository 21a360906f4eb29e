"""`tokenweir serve` and `tokenweir bench serve`.

Wiring (tokenweir/cli.py): `add_subcommands(sub)` in build_parser, and in main
`if args.command in ("serve", "bench"): return server_cli.run(args)`.
"""

from __future__ import annotations

import argparse
import logging
import os

from tokenweir.cli import add_engine_args, engine_kwargs


def add_subcommands(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None,
                       help="model (alias, HF directory or .gguf); same as --model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* "
                            "(default: $TOKENWEIR_API_KEY)")
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="name(s) clients use for the model (default: the model argument)")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 + Retry-After while this many requests wait")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds to let running requests finish on SIGTERM")
    serve.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                       help="largest request body accepted, in bytes (larger: 413)")
    serve.add_argument("--log-level", default="info")
    add_engine_args(serve)

    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenweir.bench.serve import add_args
    add_args(bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server"))


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench" and args.bench_command == "serve":
        from tokenweir.bench.serve import main as bench_main
        return bench_main(args)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from tokenweir.config import EngineConfig
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.server.serve import serve
    from tokenweir.server.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    if args.model_tag:
        kwargs["model"] = args.model_tag
    kwargs.setdefault("model", "smollm2-135m")
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**kwargs)))
    names = tuple(args.served_model_name or ()) or (kwargs["model"],)
    if engine.model_name not in names:
        names = (*names, engine.model_name)
    settings = ServerSettings(
        served_model_names=names,
        api_key=args.api_key or os.environ.get("TOKENWEIR_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout,
        max_request_body_bytes=args.max_request_body_bytes)
    return serve(engine, settings, args.host, args.port, args.log_level)


def main(argv=None) -> int:
    """Standalone entry (`python -m tokenweir.server.cli serve ...`) until the lead wires it."""
    parser = argparse.ArgumentParser(prog="tokenweir")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
