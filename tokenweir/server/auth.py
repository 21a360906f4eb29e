"""The API key check, shared by the server and the router."""

from __future__ import annotations

import hmac

from tokenweir.server.errors import APIError, error_response


class BearerAuth:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): every /v1/
    path and /timeline need `Authorization: Bearer <key>` (/timeline also takes `?key=<key>`,
    since a browser's reloads send no header); /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path == "/timeline"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if path == "/timeline" and not token:
                token = _query_key(scope)
            if not hmac.compare_digest(token, self.key):
                err = APIError("invalid or missing API key", 401, "authentication_error",
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _query_key(scope) -> bytes:
    from urllib.parse import parse_qs

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [""])
    return values[0].encode("latin-1", "replace")
