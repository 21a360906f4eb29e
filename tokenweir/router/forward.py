"""Forwarding one OpenAI request: choose a replica, send the body as it came, relay the answer.

Contracts:
- A request is tried on at most two replicas: it moves to a second one (never the same) only
  while nothing has been sent to the client, when the first could not be reached, failed before
  its first chunk (a whole answer: before it was complete), or answered 503 (draining, or too
  many waiting). When both fail, the answer is 503 `no_replica` naming the last failure.
- Once a stream has started, a replica failure ends it in-band as serve ends a failed stream:
  a `data: {"error": ...}` event, then `data: [DONE]`.
- The client leaving closes the upstream connection, which aborts the request on the replica.
- Every answer the replica gives (its 400s included) is relayed unchanged: the router adds no
  validation of its own beyond the body limit, the API key and well-formed JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Hashable, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenweir.router.flight import END, Failure, Flight, Start
from tokenweir.router.replicas import Replica, ReplicaSet
from tokenweir.server.body import parse_json
from tokenweir.server.errors import APIError

logger = logging.getLogger("tokenweir.router")
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
_RELAYED_HEADERS = ("content-type", "retry-after", "cache-control", "x-request-id")
MAX_TRIES = 2


def routing_key(body: dict) -> list[int]:
    """What prefix-aware routing hashes: the prompt's text as UTF-8 bytes. A chat's messages
    are laid out role + content per message, so a conversation's next turn extends the
    previous turn's key (its leading blocks are the same)."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = [f"{m.get('role', '')}\n{_text(m.get('content'))}\n"
                 for m in body["messages"] if isinstance(m, dict)]
        return list("".join(parts).encode("utf-8", "replace"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [t for t in prompt if isinstance(t, int)]  # token ids route as themselves
    return list(_text(prompt).encode("utf-8", "replace"))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # chat content parts, or a batch of prompts
        return "".join(_text(p.get("text") if isinstance(p, dict) else p) for p in content)
    return "" if content is None else json.dumps(content)


def session_of(body: dict, request: Request) -> Optional[Hashable]:
    """The conversation a request belongs to: the X-Session-Id header, else OpenAI's `user`."""
    header = request.headers.get("x-session-id")
    user = body.get("user")
    return header or (user if isinstance(user, str) and user else None)


class Forwarder:
    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient) -> None:
        self.replicas, self.client = replicas, client
        self.retries = 0  # requests moved to a second replica

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        stream = body.get("stream") is True
        tokens, session = routing_key(body), session_of(body, request)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        tried: set[int] = set()
        failure: Optional[str] = None
        while len(tried) < MAX_TRIES:
            replica = self.replicas.choose(tokens, session, frozenset(tried))
            if replica is None:
                break
            if tried:
                self.retries += 1
            tried.add(replica.index)
            upstream = httpx.Request("POST", replica.url + path, content=raw, headers=headers)
            answer, failure = await self._try(Flight(self.client, replica, upstream), stream,
                                              request)
            if answer is not None:
                return answer
        raise _unavailable(failure)

    async def _try(self, flight: Flight, stream: bool,
                   request: Request) -> tuple[Optional[Response], Optional[str]]:
        """(the answer, None), or (None, why) when the request may move to another replica."""
        try:
            start = await flight.next()
            if isinstance(start, Failure):
                return None, self._failed(flight.replica, start)
            if start.status == 503:
                return None, f"replica {flight.replica.url} answered 503"
            if stream and start.status == 200:
                first = await flight.next()
                if isinstance(first, Failure):
                    return None, self._failed(flight.replica, first)
                if first is END:  # an empty body
                    return Response(b"", start.status,
                                    headers=relayed_headers(start.headers)), None
                answer = self._relay(flight, start, first)
                flight = None  # the stream's body owns it now
                return answer, None
            return await self._whole(flight, start, request)
        finally:
            if flight is not None:
                await flight.close()

    def _failed(self, replica: Replica, failure: Failure) -> str:
        self.replicas.take_out(replica, failure.reason)
        return failure.reason

    async def _whole(self, flight: Flight, start: Start,
                     request: Request) -> tuple[Optional[Response], Optional[str]]:
        """A whole (non-streamed) answer, or (None, why) when the replica failed before it
        was complete (nothing has reached the client: the request may move). Ended early
        when the client leaves."""
        reading = asyncio.ensure_future(_read_all(flight))
        leaving = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
        if not reading.done():  # the client left: closing the flight aborts it upstream
            reading.cancel()
            return Response(status_code=499), None
        content, failure = reading.result()
        if failure is not None:
            flight.replica.failed += 1
            return None, self._failed(flight.replica, failure)
        return Response(content, status_code=start.status,
                        headers=relayed_headers(start.headers)), None

    def _relay(self, flight: Flight, start: Start, first: bytes) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                yield first
                while True:
                    item = await flight.next()
                    if item is END:
                        return
                    if isinstance(item, Failure):
                        flight.replica.failed += 1
                        self.replicas.take_out(flight.replica, item.reason)
                        yield _stream_error(flight.replica, item.reason)
                        return
                    yield item
            finally:  # done, or cancelled because the client left
                await flight.close()
        return StreamingResponse(body(), status_code=start.status,
                                 headers=relayed_headers(start.headers))


async def _read_all(flight: Flight) -> tuple[bytes, Optional[Failure]]:
    parts = []
    while True:
        item = await flight.next()
        if item is END:
            return b"".join(parts), None
        if isinstance(item, Failure):
            return b"", item
        parts.append(item)


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def relayed_headers(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in _RELAYED_HEADERS}


def _stream_error(replica: Replica, reason: str) -> bytes:
    """The end of a stream whose replica failed: serve's in-band error shape, then [DONE]."""
    err = APIError(f"replica {replica.url} failed mid-stream: {reason}", 502,
                   "service_unavailable", code="replica_failed")
    return f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()


def _unavailable(failure: Optional[str]) -> APIError:
    detail = f" (last failure: {failure})" if failure else ""
    return APIError(f"no replica could serve the request{detail}", 503,
                    "service_unavailable", code="no_replica", headers={"Retry-After": "1"})
