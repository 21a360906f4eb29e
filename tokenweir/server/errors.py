"""The error shape every HTTP answer of tokenweir uses (the server's and the router's):
OpenAI's `{"error": {"message", "type", "param", "code"}}` with its status and headers.
Imports nothing of tokenweir, so every module that raises or answers an error can use it."""

from __future__ import annotations

import json
from typing import Any, Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class ErrorJSON(JSONResponse):
    """Error bodies are ASCII-escaped: a message may quote client text that is not valid
    UTF-8 (a lone surrogate), which must not turn a 400 into a failure to answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    return ErrorJSON(err.body(), status_code=err.status, headers=err.headers)
