"""Reading request bodies safely: a size cap (413) enforced while the body streams in, and JSON
parsing that turns every malformed input (bad syntax, nesting too deep, lone surrogates) into a
400 instead of an exception deeper down."""

from __future__ import annotations

import json
from typing import Any

from tokenweir.server.errors import APIError, error_response

Scope = dict
ASGIApp = Any


class BodyLimit:
    """Pure ASGI middleware: a request whose body exceeds `max_bytes` is answered 413 as soon
    as the Content-Length says so, or as soon as that many bytes have streamed in; the
    application never sees it. Streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive):
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(self._message(), 413, code="request_too_large")
            return message
        return counted

    def _message(self) -> str:
        return (f"the request body is larger than {self.max_bytes} bytes "
                "(--max-request-body-bytes)")

    async def _refuse(self, scope: Scope, receive, send) -> None:
        err = APIError(self._message(), 413, code="request_too_large",
                       headers={"Connection": "close"})
        await error_response(err)(scope, receive, send)


def parse_json(raw: bytes) -> Any:
    """The JSON value of a body; APIError(400) for anything a client got wrong."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise APIError("malformed JSON body: nested too deeply") from None
    if b"\\ud" in raw or b"\\uD" in raw:  # an escaped surrogate: it may be unpaired
        _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(value: Any) -> None:
    """APIError naming the top-level field of the first string (or key) that is not valid
    Unicode text. Iterative: the depth of `value` is whatever json.loads accepted."""
    stack: list[tuple[Any, Any]] = [(None, value)]
    while stack:
        field, item = stack.pop()
        if isinstance(item, dict):
            for key, sub in item.items():
                top = key if field is None else field
                _check_text(key, top)
                stack.append((top, sub))
        elif isinstance(item, list):
            stack.extend((field, sub) for sub in item)
        elif isinstance(item, str):
            _check_text(item, field)


def _check_text(text: str, field: Any) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        name = field.encode("utf-8", "backslashreplace").decode() if field else None
        raise APIError("a string contains a lone UTF-16 surrogate (not valid Unicode text)"
                       + (f" in '{name}'" if name else ""), param=name) from None
