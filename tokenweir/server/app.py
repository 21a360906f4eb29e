"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenweir.engine.async_engine import AsyncEngine, EngineDeadError
from tokenweir.server import protocol as P
from tokenweir.server.metrics import make_registry

logger = logging.getLogger("tokenweir.server")


@dataclass
class ServerSettings:
    served_model_names: tuple[str, ...]
    api_key: Optional[str] = None
    max_waiting_requests: Optional[int] = None  # None: unbounded
    drain_timeout: float = 30.0


def error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    registry = make_registry(engine, settings.served_model_names[0])
    state = {"draining": False}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start(asyncio.get_running_loop())
        yield
        state["draining"] = True
        await engine.drain(settings.drain_timeout)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="tokenweir", lifespan=lifespan)
    app.state.engine = engine

    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)

    @app.exception_handler(P.APIError)
    async def api_error(_request: Request, err: P.APIError):
        return error_response(err)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception):
        logger.exception("unhandled error")
        return error_response(P.APIError(f"internal error: {err}", 500, "internal_error"))

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": P.now(), "owned_by": "tokenweir",
             "root": engine.model_name, "max_model_len": engine.max_model_len}
            for name in settings.served_model_names]}

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise P.APIError(f"malformed JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise P.APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in settings.served_model_names:
            raise P.APIError(f"the model '{model}' does not exist; this server serves "
                             f"{list(settings.served_model_names)}", 400, param="model",
                             code="model_not_found")
        return body

    def admit() -> None:
        if state["draining"] or not engine.is_running:
            raise P.APIError("the server is shutting down", 503, "service_unavailable",
                             headers={"Retry-After": "5"})
        limit = settings.max_waiting_requests
        if limit is not None and engine.num_unstarted >= limit:
            raise P.APIError(f"too many waiting requests ({engine.num_unstarted} >= {limit}); "
                             "retry later", 503, "service_unavailable",
                             headers={"Retry-After": "1"})

    async def start(prompt: Any, parsed: P.Parsed, request_id: str) -> asyncio.Queue:
        admit()
        try:
            return await engine.add(prompt, parsed.params, request_id, parsed.priority,
                                    parsed.ttft_slo_ms)
        except ValueError as exc:
            raise P.APIError(str(exc), param="prompt") from exc
        except EngineDeadError as exc:
            raise P.APIError(str(exc), 503, "service_unavailable",
                             headers={"Retry-After": "5"}) from exc

    def model_of(body: dict) -> str:
        return body.get("model") or settings.served_model_names[0]

    async def collect(request_id: str, queue) -> tuple[P.Accumulator, list]:
        """Run a non-streamed request to its end: the accumulated output and logprob entries."""
        acc = P.Accumulator()
        entries: list = []
        async for out in engine.stream(request_id, queue):
            _, _, new = acc.add(out)
            entries.extend(new)
        return acc, entries

    # ---- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        parsed = P.parse_sampling(body, chat=False)
        prompt = P.parse_prompt(body)
        echo = P.field(body, "echo", bool, False)
        request_id = P.new_id("cmpl")
        queue = await start(prompt, parsed, request_id)
        model = model_of(body)
        k = parsed.top_logprobs
        tok = engine.tokenizer
        if parsed.stream:
            return sse(stream_completion(request_id, queue, model, parsed, k, tok))
        acc, entries = await collect(request_id, queue)
        text = acc.text
        if echo and isinstance(prompt, str):
            text = prompt + text
        choice = {"index": 0, "text": text, "finish_reason": acc.finish_reason,
                  "stop_reason": acc.stop_reason,
                  "logprobs": (P.completion_logprobs(tok, acc.token_ids, entries, k, 0)
                               if k is not None else None)}
        return {"id": request_id, "object": "text_completion", "created": P.now(),
                "model": model, "choices": [choice],
                "usage": P.usage(acc.prompt_tokens, len(acc.token_ids))}

    async def stream_completion(request_id, queue, model, parsed, k, tok
                                ) -> AsyncIterator[dict]:
        acc = P.Accumulator()
        created = P.now()
        offset = 0
        async for out in engine.stream(request_id, queue):
            text, token_ids, entries = acc.add(out)
            if not text and not token_ids and not out.finished:
                continue
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": acc.finish_reason if out.finished else None,
                      "stop_reason": acc.stop_reason if out.finished else None}
            if k is not None:
                choice["logprobs"] = P.completion_logprobs(tok, token_ids, entries, k, offset)
            offset += len(text)
            chunk = {"id": request_id, "object": "text_completion", "created": created,
                     "model": model, "choices": [choice]}
            if parsed.include_usage:
                chunk["usage"] = None
            yield chunk
        if parsed.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model, "choices": [],
                   "usage": P.usage(acc.prompt_tokens, len(acc.token_ids))}

    # ---- /v1/chat/completions ----------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        parsed = P.parse_sampling(body, chat=True)
        messages = P.parse_messages(body)
        try:
            prompt = engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=P.field(body, "add_generation_prompt", bool,
                                                        True))
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's
            raise P.APIError(f"cannot apply the chat template: {exc}",
                             param="messages") from exc
        request_id = P.new_id("chatcmpl")
        queue = await start(prompt, parsed, request_id)
        model = model_of(body)
        k = parsed.top_logprobs
        tok = engine.tokenizer
        if parsed.stream:
            return sse(stream_chat(request_id, queue, model, parsed, k, tok))
        acc, entries = await collect(request_id, queue)
        choice = {"index": 0, "message": {"role": "assistant", "content": acc.text},
                  "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
                  "logprobs": (P.chat_logprobs(tok, acc.token_ids, entries, k)
                               if k is not None else None)}
        return {"id": request_id, "object": "chat.completion", "created": P.now(),
                "model": model, "choices": [choice],
                "usage": P.usage(acc.prompt_tokens, len(acc.token_ids))}

    async def stream_chat(request_id, queue, model, parsed, k, tok) -> AsyncIterator[dict]:
        acc = P.Accumulator()
        created = P.now()
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model}
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
        if parsed.include_usage:
            first["usage"] = None
        yield first
        async for out in engine.stream(request_id, queue):
            text, token_ids, entries = acc.add(out)
            if not text and not token_ids and not out.finished:
                continue
            choice = {"index": 0, "delta": {"content": text} if text else {},
                      "logprobs": (P.chat_logprobs(tok, token_ids, entries, k)
                                   if k is not None else None),
                      "finish_reason": acc.finish_reason if out.finished else None}
            if out.finished:
                choice["stop_reason"] = acc.stop_reason
            chunk = {**base, "choices": [choice]}
            if parsed.include_usage:
                chunk["usage"] = None
            yield chunk
        if parsed.include_usage:
            yield {**base, "choices": [],
                   "usage": P.usage(acc.prompt_tokens, len(acc.token_ids))}

    return app


class BearerAuth:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): every /v1/
    path needs `Authorization: Bearer <key>`; /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = P.APIError("invalid or missing API key", 401, "authentication_error",
                                 code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        except Exception as exc:  # noqa: BLE001 - report mid-stream errors in-band
            logger.exception("stream failed")
            err = P.APIError(str(exc), 500, "internal_error")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
