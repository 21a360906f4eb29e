"""What `tokenweir router` runs (tokenweir/cli builds the parser from config.RouterConfig; this
module never imports it)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

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
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_keep_alive=30, backlog=4096)
    return 0
