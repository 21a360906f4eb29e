"""The router's GET /timeline and GET /profile: serve's per-process pages, one replica's each.

Contracts:
- `?replica=I` (I an index in --replica order, or the replica's URL) forwards the GET to that
  replica with the other query parameters (`key`, `reset`) and the Authorization header, and
  relays its answer unchanged (status, body, content type): the replica's own schedule page,
  or its serving profile (404 there when it runs without --profile-serving).
- Without `replica`: GET /profile answers `{"replicas": {URL: answer}}` with every replica's
  answer (its profile, or its error body; `{"error": ...}` for one that is out or did not
  answer), `reset` passed to each. GET /timeline relays the only replica's page, or, with
  several, answers a page that links each one's (keeping `?key=`).
- An unknown replica is 404; one that is out, or fails to answer, is 503 `replica_failed`
  (and is taken out, as a failed request takes it out).
"""

from __future__ import annotations

import asyncio
import html
from typing import Optional
from urllib.parse import urlencode

import httpx
from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenweir.router.forward import relayed_headers
from tokenweir.router.replicas import Replica, ReplicaSet, describe
from tokenweir.server.errors import APIError


def pick(replicas: ReplicaSet, name: str) -> Replica:
    """The replica `?replica=` names: an index, or a URL as given to --replica."""
    for r in replicas.replicas:
        if name == str(r.index) or name.rstrip("/") == r.url:
            return r
    raise APIError(f"no replica {name!r}: give an index 0..{len(replicas.replicas) - 1} or "
                   "a --replica URL", 404, "not_found", param="replica")


async def fetch(client: httpx.AsyncClient, replicas: ReplicaSet, replica: Replica,
                path: str, request: Request) -> httpx.Response:
    """`path` on `replica` with the request's query (less `replica`) and Authorization."""
    if not replica.up:
        raise _failed(replica, replica.last_error or "it is out")
    query = urlencode([(k, v) for k, v in request.query_params.multi_items()
                       if k != "replica"])
    auth = request.headers.get("authorization")
    try:
        return await client.get(replica.url + path + (f"?{query}" if query else ""),
                                headers={"authorization": auth} if auth else {})
    except httpx.HTTPError as exc:
        replicas.take_out(replica, describe(exc))
        raise _failed(replica, describe(exc)) from exc


async def one_replica(client: httpx.AsyncClient, replicas: ReplicaSet, path: str,
                      request: Request, name: str) -> Response:
    answer = await fetch(client, replicas, pick(replicas, name), path, request)
    return Response(answer.content, answer.status_code,
                    headers=relayed_headers(answer.headers))


async def every_profile(client: httpx.AsyncClient, replicas: ReplicaSet,
                        request: Request) -> JSONResponse:
    async def answer_of(replica: Replica) -> dict:
        try:
            answer = await fetch(client, replicas, replica, "/profile", request)
        except APIError as err:
            return err.body()
        try:
            return answer.json()
        except ValueError:
            return _failed(replica, f"/profile answered {answer.status_code} without "
                                    "JSON").body()
    answers = await asyncio.gather(*(answer_of(r) for r in replicas.replicas))
    return JSONResponse({"replicas": {r.url: a for r, a in zip(replicas.replicas, answers)}})


def timeline_index(replicas: ReplicaSet, key: Optional[str]) -> HTMLResponse:
    """A page linking each replica's schedule page through the router."""
    items = []
    for r in replicas.replicas:
        query = urlencode({"replica": r.index, **({"key": key} if key else {})})
        state = "up" if r.up else f"out: {r.last_error or 'not checked yet'}"
        items.append(f'<li><a href="/timeline?{html.escape(query)}">replica {r.index}: '
                     f'{html.escape(r.url)}</a> ({html.escape(state)})</li>')
    return HTMLResponse("<!doctype html><title>tokenweir router: timelines</title>"
                        "<h1>Each replica's schedule</h1><ul>" + "".join(items) + "</ul>")


async def page(client: httpx.AsyncClient, replicas: ReplicaSet, path: str,
               request: Request) -> Response:
    """GET /timeline or /profile at the router (see the module docstring)."""
    name = request.query_params.get("replica")
    if name is not None:
        return await one_replica(client, replicas, path, request, name)
    if path == "/profile":
        return await every_profile(client, replicas, request)
    if len(replicas.replicas) == 1:
        return await one_replica(client, replicas, path, request, "0")
    return timeline_index(replicas, request.query_params.get("key"))


def _failed(replica: Replica, reason: str) -> APIError:
    return APIError(f"replica {replica.url} failed: {reason}", 503, "service_unavailable",
                    code="replica_failed", headers={"Retry-After": "1"})
