"""`create_app(engine, settings)`: the FastAPI app with the OpenAI routes, /health and /metrics.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (behind the API key when
one is set), GET /health, GET /metrics. Every error is an OpenAI error object. Prompts are
tokenized and checked on the event loop (`LLMEngine.prompt_ids` reads only immutable state); all
else the engine does happens on its own thread (`AsyncEngine`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from kvabi.cache.block_events import BlockEventLog
from kvabi.disagg.roles import DecodeRole, PrefillRole, PromptFeeds
from kvabi.disagg.settings import DisaggSettings
from kvabi.engine.async_engine import AsyncEngine
from kvabi.engine.engine import EngineHooks, LLMEngine
from kvabi.server.errors import APIError, from_validation_error
from kvabi.server.http_limits import BodyDeadline, BodyTimeout, body_timeout_response
from kvabi.server.kv_events import start_publisher, tokenize_routes
from kvabi.server.metrics import ServerMetrics
from kvabi.server.middleware import BodyLimit, CountResponses
from kvabi.server.prompts import PreparedRequest, prepare_chat, prepare_completion
from kvabi.server.protocol import ChatRequest, CompletionRequest
from kvabi.server.responses import ChatResponses, CompletionResponses, Responses
from kvabi.server.serving import Serving
from kvabi.server.settings import ServerSettings

log = logging.getLogger("kvabi.server")
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", CompletionRequest, ChatRequest)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def server_hooks(
    settings: ServerSettings, disagg: DisaggSettings | None = None, tp_size: int = 1
) -> EngineHooks:
    """What a server's engine is built with: a block-event log to publish (`--kv-events`), and
    on a prefill instance whose transport streams layers, the feeds that send them (not under
    TP, `tp_size` > 1: rank 0 holds only its heads mid-forward; the whole blocks are gathered
    and sent once the prompt is computed)."""
    events = BlockEventLog("CPU") if settings.kv_events is not None else None  # host memory
    feeds = None
    is_prefill = disagg is not None and disagg.role == "prefill"
    if is_prefill and disagg.transport_type.streams_layers and tp_size == 1:
        feeds = PromptFeeds()
    return EngineHooks(on_prompt_layer=feeds, block_events=events)


def create_app(
    engine: LLMEngine, settings: ServerSettings, disagg: DisaggSettings | None = None
) -> FastAPI:
    """The app; the engine thread (and a disaggregation role's endpoint or peer connections)
    starts and stops with the app's lifespan."""
    metrics = ServerMetrics()
    max_in_flight = engine.config.max_num_seqs + settings.max_queued
    engine_loop = AsyncEngine(engine, max_in_flight, observer=metrics)
    metrics.watch_engine(lambda: engine_loop.snapshot)
    prefill = PrefillRole(disagg, engine_loop) if disagg and disagg.role == "prefill" else None
    decode = DecodeRole(disagg, engine_loop) if disagg and disagg.role == "decode" else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        events = None
        if settings.kv_events is not None:  # before the engine thread touches the pool
            events = start_publisher(
                engine, settings.kv_events, settings.kv_events_replay, settings.kv_events_format
            )
        engine_loop.start()
        try:
            if prefill is not None:
                prefill.start()
            if decode is not None:
                await decode.start()
            yield
        finally:
            for role in (prefill, decode):
                if role is not None:
                    role.stop()
            engine_loop.stop()
            if events is not None:
                events.close()

    app = FastAPI(title="kvabi", lifespan=lifespan)
    app.state.serving = Serving(engine_loop, metrics, settings, int(time.time()), decode)
    app.include_router(open_routes)
    app.include_router(v1_routes)
    app.include_router(tokenize_routes, dependencies=[Depends(require_api_key)])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(BodyTimeout, body_timeout_response)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    app.add_middleware(CountResponses, counter=metrics.http_requests, routes=ROUTES)
    return app


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def require_api_key(request: Request) -> None:
    """With an API key set, /v1/* needs `Authorization: Bearer <key>`: else 401."""
    key = _serving(request).settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            "missing or incorrect API key: send `Authorization: Bearer <key>`",
            code="invalid_api_key",
        )


open_routes = APIRouter()
v1_routes = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@open_routes.get("/health")
async def get_health(request: Request) -> JSONResponse:
    """200 while the engine thread runs and makes progress; 503 once it stopped, or once it
    has had work without computing a token for `stall_timeout_s`."""
    s = _serving(request)
    engine = s.async_engine
    if not engine.is_alive:
        return JSONResponse({"status": "engine stopped"}, 503)
    stalled = engine.seconds_without_progress
    if stalled > s.settings.stall_timeout_s:
        snap = engine.snapshot
        body = {
            "status": "engine stalled",
            "seconds_without_progress": round(stalled, 1),
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "free_blocks": snap.num_free_blocks,
        }
        return JSONResponse(body, 503)
    return JSONResponse({"status": "ok"}, 200)


@open_routes.get("/metrics")
async def get_metrics(request: Request) -> Response:
    return Response(_serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@v1_routes.get("/models")
async def list_models(request: Request) -> JSONResponse:
    s = _serving(request)
    model = {
        "id": s.settings.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "kvabi",
        "max_model_len": s.engine.info.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


@v1_routes.post("/completions")
async def create_completion(request: Request) -> Response:
    return await _generate(request, CompletionRequest, prepare_completion, CompletionResponses)


@v1_routes.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, ChatRequest, prepare_chat, ChatResponses)


async def _generate(
    request: Request,
    schema: type[R],
    prepare: Callable[[R, LLMEngine], PreparedRequest],
    responses: type[Responses],
) -> Response:
    s = _serving(request)
    req = await _parse(request, schema)
    s.check_model(req.model)
    prepared = prepare(req, s.engine)
    return await s.respond(
        request, req, prepared, responses(s.settings.model_name, s.engine.tokenizer)
    )


async def _parse(request: Request, schema: type[M]) -> M:
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error = APIError(
        exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
    )
    return JSONResponse(error.body(), error.status, headers=exc.headers)


async def _client_gone(request: Request, _: Exception) -> Response:
    """The client left while sending its request: one line, not a traceback."""
    client = request.client.host if request.client else "?"
    log.info("client %s disconnected before its request was read (%s)", client, request.url.path)
    return Response(status_code=499)  # nobody reads it


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    error = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(error.body(), error.status)
