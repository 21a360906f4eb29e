"""The router's HTTP app: every route of tokenweir serve. The OpenAI ones are forwarded to
the replica the routing policy picks (forward.py), /timeline and /profile to the one the query
names (replica_pages.py); /health, /metrics and /v1/models answer for the deployment. Serve's
API key check, body limit and error shapes (server/auth.py, server/body.py, server/errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenweir.config import RouterConfig
from tokenweir.router.forward import Forwarder, relayed_headers
from tokenweir.router.metrics import scrape
from tokenweir.router.replica_pages import page
from tokenweir.router.replicas import ReplicaSet, describe
from tokenweir.routing import routing_policy_class
from tokenweir.server.auth import BearerAuth
from tokenweir.server.body import BodyLimit
from tokenweir.server.errors import APIError, error_response

logger = logging.getLogger("tokenweir.router")


@dataclass
class RouterState:
    config: RouterConfig
    replicas: ReplicaSet
    client: Optional[httpx.AsyncClient] = None
    forwarder: Optional[Forwarder] = None
    _health: Optional[asyncio.Task] = field(default=None, repr=False)


def create_router_app(config: RouterConfig) -> FastAPI:
    policy = routing_policy_class(config.routing_policy)(len(config.replicas),
                                                         config.routing_block_bytes)
    replicas = ReplicaSet(list(config.replicas), policy, config.health_interval,
                          config.health_timeout)
    app = FastAPI(title="tokenweir router", lifespan=_lifespan)
    app.state.router = RouterState(config, replicas)
    _add_routes(app)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    if config.api_key:
        app.add_middleware(BearerAuth, api_key=config.api_key)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: RouterState = app.state.router
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(None, connect=state.config.health_timeout)
    state.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    state.forwarder = Forwarder(state.replicas, state.client)
    await state.replicas.start()
    state._health = asyncio.create_task(state.replicas.run_health_checks())
    yield
    state._health.cancel()
    await state.replicas.close()
    await state.client.aclose()


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while at least one replica takes requests."""
        up = _state(request).replicas.any_up() is not None
        return Response(status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = _state(request)
        text = await scrape(state.client, state.replicas, state.forwarder.retries)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The models of a replica that is up (every replica serves the same ones)."""
        state = _state(request)
        replica = state.replicas.any_up()
        if replica is None:
            raise APIError("no replica is up", 503, "service_unavailable", code="no_replica",
                           headers={"Retry-After": "1"})
        auth = request.headers.get("authorization")
        try:
            answer = await state.client.get(replica.url + "/v1/models",
                                            headers={"authorization": auth} if auth else {})
        except httpx.HTTPError as exc:
            state.replicas.take_out(replica, describe(exc))
            raise APIError(f"replica {replica.url} failed: {describe(exc)}", 502,
                           "service_unavailable", code="replica_failed") from exc
        return Response(answer.content, answer.status_code, headers=relayed_headers(answer.headers))

    @app.get("/timeline")
    async def timeline(request: Request) -> Response:
        """A replica's schedule page (router/replica_pages.py: ?replica=I)."""
        state = _state(request)
        return await page(state.client, state.replicas, "/timeline", request)

    @app.get("/profile")
    async def profile(request: Request) -> Response:
        """Each replica's serving profile, or one's with ?replica=I (replica_pages.py)."""
        state = _state(request)
        return await page(state.client, state.replicas, "/profile", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _state(request).forwarder.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _state(request).forwarder.forward(request, "/v1/chat/completions")


async def _api_error(_request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _internal_error(_request: Request, err: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return error_response(APIError(f"internal error: {err}", 500, "internal_error"))
