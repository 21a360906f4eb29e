"""The HTTP routes. Each reads the shared `AppState` (tokenweir.server.state) from the app;
none holds state of its own. Request bodies are validated by the models of
tokenweir.server.models, whose schemas the OpenAPI document publishes."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import AsyncIterator, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenweir.server import protocol as P
from tokenweir.server.body import parse_json
from tokenweir.server.models import ChatCompletionRequest, CompletionRequest, parse
from tokenweir.server.shapes import ChatShape, CompletionShape, Shape, collect, stream_chunks
from tokenweir.server.state import AppState, app_state
from tokenweir.server.tool_calls import tools_for_template

logger = logging.getLogger("tokenweir.server")
router = APIRouter()


def _body_of(model: type) -> dict:
    """OpenAPI: the route's JSON body is `model` (validated by hand, to answer OpenAI's 400)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _json_object(title: str) -> dict:
    """A route that returns a plain dict, served as JSON without FastAPI's response model:
    declaring `-> dict` made FastAPI build a response field, whose check for pydantic v1
    models imports `pydantic.v1` (~0.06-0.09 s of every `tokenweir serve` start). The OpenAPI
    document still says what the return annotation said (test_server_start.py compares it)."""
    return {"response_model": None, "responses": {200: {"content": {"application/json": {
        "schema": {"additionalProperties": True, "title": title, "type": "object"}}}}}}


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=200 if app_state(request).engine.is_running else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(app_state(request).registry),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/timeline", response_class=HTMLResponse)
async def timeline(request: Request) -> HTMLResponse:
    """The schedule page over the server's most recent steps (tokenweir/timeline); it
    reloads itself every 2 s. 404 when the server runs with --timeline-steps 0."""
    ring = app_state(request).timeline
    if ring is None:
        raise P.APIError("the timeline is off (--timeline-steps 0)", 404, "not_found")
    from tokenweir.timeline.page import render_traces

    loop = asyncio.get_running_loop()  # the trace may come from the core process: not here
    trace = await loop.run_in_executor(None, ring.trace, {"label": "live"})
    trace.steps.sort(key=lambda s: s["step"])
    page = await loop.run_in_executor(None, render_traces, [trace], "tokenweir: live schedule",
                                      2.0)
    return HTMLResponse(page)


@router.get("/profile", **_json_object("Response Profile Profile Get"))
async def profile(request: Request):
    """The serving profile so far (tokenweir serve --profile-serving; 404 without it).
    `?reset=1` starts a new one after answering (e.g. after a warm-up)."""
    engine = app_state(request).engine
    if engine.profile is None:
        raise P.APIError("profiling is off (tokenweir serve --profile-serving)", 404,
                         "not_found")
    snapshot = engine.profile.snapshot()
    if request.query_params.get("reset"):
        engine.profile.reset()
    return snapshot


@router.get("/v1/models", **_json_object("Response Models V1 Models Get"))
async def models(request: Request):
    state = app_state(request)
    engine = state.engine
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": P.now(), "owned_by": "tokenweir",
         "root": engine.model_name, "max_model_len": engine.max_model_len}
        for name in state.settings.served_model_names]}


@router.post("/v1/completions", openapi_extra=_body_of(CompletionRequest))
async def completions(request: Request):
    state = app_state(request)
    req = parse(CompletionRequest, parse_json(await request.body()))
    model = state.model_name(req.model)
    parsed = P.sampling(req, chat=False, vocab_size=state.engine.engine.vocab_size)
    prompt = P.prompt_of(req)
    echo = prompt if req.echo and isinstance(prompt, str) else None
    shape = CompletionShape(P.new_id("cmpl"), model, parsed, state.engine.tokenizer, echo=echo)
    return await _answer(state, shape, prompt)


@router.post("/v1/chat/completions", openapi_extra=_body_of(ChatCompletionRequest))
async def chat(request: Request):
    state = app_state(request)
    req = parse(ChatCompletionRequest, parse_json(await request.body()))
    model = state.model_name(req.model)
    parsed = P.sampling(req, chat=True, vocab_size=state.engine.engine.vocab_size)
    add_generation_prompt = req.add_generation_prompt is not False
    tools = tools_for_template(req, state.engine.tokenizer.chat_template_takes_tools)
    state.admit()  # refuse before the template work when the server cannot take it anyway
    extra = {} if tools is None else {"tools": tools}
    try:
        prompt = await state.engine.render_chat(P.messages_of(req), add_generation_prompt,
                                                **extra)
    except ValueError as exc:
        raise P.APIError(str(exc), param="messages") from exc
    shape = ChatShape(P.new_id("chatcmpl"), model, parsed, state.engine.tokenizer,
                      tool_calls=tools is not None,
                      parallel_tool_calls=req.parallel_tool_calls is not False)
    return await _answer(state, shape, prompt)


async def _answer(state: AppState, shape: Shape, prompt) -> object:
    """Queue the request, then stream its chunks (SSE) or return its whole answer."""
    queue = await state.submit(prompt, shape.parsed, shape.request_id)
    outputs = state.engine.stream(shape.request_id, queue)
    if shape.parsed.stream:
        on_write = None
        if state.engine.profile is not None:
            on_write = functools.partial(state.engine.note_written, shape.request_id)
        return sse(stream_chunks(shape, outputs), on_write)
    return await collect(shape, outputs)


def sse(chunks: AsyncIterator[dict],
        on_write: Optional[Callable[[float], None]] = None) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, an in-band error if the request fails
    mid-stream, and `data: [DONE]` always last. `on_write(started)` (profiling) is called
    once each chunk has been handed to the transport, with the perf_counter time its
    serialization began."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                started = time.perf_counter()
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
                if on_write is not None:  # the response has sent the chunk when we resume
                    on_write(started)
        except Exception as exc:  # noqa: BLE001 - report mid-stream errors in-band
            logger.exception("stream failed")
            err = P.APIError(str(exc), 500, "internal_error")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
