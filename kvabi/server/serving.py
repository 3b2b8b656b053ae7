"""`Serving`: a checked request in, engine work queued, the OpenAI response (streamed or not) out.

Whatever ends a request early (a client that disconnects, a cancelled handler) aborts it in the
engine, which frees its blocks (`disconnect.py`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvabi.disagg.roles import KV_HEADER, PEER_HEADER, DecodeRole
from kvabi.engine.async_engine import AsyncEngine, OverloadedError
from kvabi.engine.engine import LLMEngine
from kvabi.engine.outputs import RequestOutput
from kvabi.engine.request_handle import EngineError, RequestHandle
from kvabi.server.disconnect import ClientDisconnected, EventStream, cancel_on_disconnect
from kvabi.server.errors import APIError
from kvabi.server.metrics import ServerMetrics
from kvabi.server.prompts import PreparedRequest
from kvabi.server.protocol import GenerationRequest
from kvabi.server.responses import Responses
from kvabi.server.settings import ServerSettings


@dataclass
class Serving:
    """The app's state: the engine loop, its metrics and the settings."""

    async_engine: AsyncEngine
    metrics: ServerMetrics
    settings: ServerSettings
    created: int  # start time, for /v1/models
    decode: DecodeRole | None = None  # a decode instance fetches prompts' KV from prefill peers

    @property
    def engine(self) -> LLMEngine:
        """The engine, for what is immutable after start-up (tokenizer, info, config)."""
        return self.async_engine.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(
                404,
                f"model: {name!r} is not served here; this server serves "
                f"{self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def respond(
        self, request: Request, req: GenerationRequest, prepared: PreparedRequest, r: Responses
    ) -> Response:
        kv_source = await self._pull_kv(request, prepared)
        response = await self._respond(request, req, prepared, r)
        if kv_source is not None:
            response.headers[KV_HEADER] = kv_source
        return response

    async def _respond(
        self, request: Request, req: GenerationRequest, prepared: PreparedRequest, r: Responses
    ) -> Response:
        handle = self._submit(prepared)
        if req.stream:
            events = self._events(handle, r, req.include_usage)
            return EventStream(events, on_close=lambda: self.async_engine.abort(handle))
        try:
            out = await cancel_on_disconnect(request, self._final(handle))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; logged as client closed
        finally:
            self.async_engine.abort(handle)  # no-op once finished
        return JSONResponse(r.body(out))

    async def _pull_kv(self, request: Request, prepared: PreparedRequest) -> str | None:
        """Decode role: the prompt's KV from a prefill peer into the pool, before admission."""
        if self.decode is None:
            return None
        peer = request.headers.get(PEER_HEADER)
        try:
            return await self.decode.pull(peer, prepared.prompt_ids, prepared.params)
        except EngineError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc

    def _submit(self, prepared: PreparedRequest) -> RequestHandle:
        try:
            return self.async_engine.submit(prepared.prompt_ids, prepared.params)
        except EngineError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc
        except OverloadedError as exc:
            retry = str(self.settings.retry_after_s)
            raise APIError(
                503,
                f"the server is at capacity ({exc}); retry after {retry} s",
                type="server_overloaded",
                code="server_overloaded",
                headers={"Retry-After": retry},
            ) from exc

    @staticmethod
    async def _final(handle: RequestHandle) -> RequestOutput:
        try:
            return await handle.final()
        except EngineError as exc:
            raise APIError(500, str(exc), type="server_error") from exc

    @staticmethod
    async def _events(
        handle: RequestHandle, r: Responses, include_usage: bool
    ) -> AsyncIterator[str]:
        try:
            for chunk in r.opening_chunks(handle.params.n, include_usage):
                yield _event(chunk)
            async for out in handle.updates():
                if out.outputs:
                    yield _event(r.chunk(out.outputs, include_usage))
            if include_usage:
                yield _event(r.usage_chunk(len(handle.prompt_ids), handle.num_generated))
        except EngineError as exc:
            yield _event(APIError(500, str(exc), type="server_error").body())
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
