"""The server's KV events: its cache's block events (every pool's, each naming its block group)
published in vLLM's format, and the route a prefix-aware router asks for a request's token ids
and hash root.

`kvabi serve --kv-events tcp://127.0.0.1:PORT` (any role) builds the engine with a
`BlockEventLog` (`server_hooks`) and publishes it (kvabi/routing/kv_event_publisher.py). The
router cannot hash a request by itself: the tokenizer, the chat template and the model's
compat digest live here, so `POST /kvabi/tokenize/v1/completions` (or `/v1/chat/completions`)
takes the very body the generation route takes and answers `{"token_ids", "hash_root",
"block_size"}`; the router hashes the ids for each block size its instances use (docs:
kvabi/routing/router.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse

from kvabi.cache.block_events import BlockEventLog
from kvabi.engine.engine import LLMEngine
from kvabi.routing.kv_event_publisher import KVEventPublisher
from kvabi.server.errors import APIError, from_validation_error
from kvabi.server.prompts import PreparedRequest, prepare_chat, prepare_completion
from kvabi.server.protocol import ChatRequest, CompletionRequest

R = TypeVar("R", CompletionRequest, ChatRequest)
tokenize_routes = APIRouter(prefix="/kvabi/tokenize")


def start_publisher(
    engine: LLMEngine, endpoint: str, replay_endpoint: str | None = None, form: str = "map"
) -> KVEventPublisher:
    """Bind the publisher over the event log the engine was built with (`server_hooks`)."""
    events = engine.hooks.block_events
    if not isinstance(events, BlockEventLog):
        raise ValueError("kv_events: build the engine with server_hooks(settings) to publish")
    return KVEventPublisher(endpoint, events, replay_endpoint, form=form).start()


@tokenize_routes.post("/v1/completions")
async def tokenize_completion(request: Request) -> JSONResponse:
    return await _tokenize(request, CompletionRequest, prepare_completion)


@tokenize_routes.post("/v1/chat/completions")
async def tokenize_chat(request: Request) -> JSONResponse:
    return await _tokenize(request, ChatRequest, prepare_chat)


async def _tokenize(
    request: Request, schema: type[R], prepare: Callable[[R, LLMEngine], PreparedRequest]
) -> JSONResponse:
    """The prompt as the generation route would queue it (same checks, same errors)."""
    serving = request.app.state.serving
    try:
        req = schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    serving.check_model(req.model)
    engine: LLMEngine = serving.engine
    prepared = prepare(req, engine)
    if not engine.cache.is_prefix_caching:
        raise APIError(404, "this instance has no prefix cache", code="no_prefix_cache")
    root = engine.cache.hasher.root(prepared.params.cache_salt)  # pure
    body = {
        "token_ids": prepared.prompt_ids,
        "hash_root": root.hex(),
        "block_size": engine.cache.block_size,
    }
    return JSONResponse(body)
