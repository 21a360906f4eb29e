"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): `create_app` assembles the
routes (tokenweir.server.routes), the shared state, the error handlers and the middleware."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema

from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.server import protocol as P
from tokenweir.server.auth import BearerAuth
from tokenweir.server.body import BodyLimit
from tokenweir.server.errors import error_response
from tokenweir.server.metrics import make_registry
from tokenweir.server.models import REQUEST_MODELS
from tokenweir.server.routes import router
from tokenweir.server.settings import ServerSettings
from tokenweir.server.state import AppState

__all__ = ["ServerSettings", "create_app", "build_app", "error_response"]

logger = logging.getLogger("tokenweir.server")


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    state = AppState(engine, settings, make_registry(engine, settings.served_model_names[0]))
    app = FastAPI(title="tokenweir", lifespan=_lifespan)
    state.timeline = _record_timeline(engine, settings.timeline_steps)
    app.state.tokenweir = state
    app.state.engine = engine
    app.include_router(router)
    app.add_exception_handler(P.APIError, _api_error)
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(Exception, _internal_error)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    app.openapi = lambda: _openapi(app)
    return app


build_app = create_app  # the name server/cli.py has always called


def _record_timeline(engine: AsyncEngine, steps: int):
    """A ring of the last `steps` step records for GET /timeline (None: off)."""
    return engine.step_ring(steps) if steps > 0 else None


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: AppState = app.state.tokenweir
    if not state.engine.is_running:
        state.engine.start(asyncio.get_running_loop())
    yield
    await state.drain()
    await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)


async def _api_error(_request: Request, err: P.APIError) -> JSONResponse:
    return error_response(err)


async def _too_deep(_request: Request, _err: RecursionError) -> JSONResponse:
    return error_response(P.APIError("the request is nested too deeply"))


async def _internal_error(_request: Request, err: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return error_response(P.APIError(f"internal error: {err}", 500, "internal_error"))


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document plus the request models the routes validate by hand."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema
