"""ASGI middleware: a cap on request body size, and a count of responses by route and status."""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import Counter
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvabi.server.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body exceeds {limit} bytes", param=None, code="request_too_large"
    )


class BodyLimit:
    """Refuse bodies over `max_bytes`: at once by Content-Length, else while they are read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            error = too_large(self.max_bytes)
            return await JSONResponse(error.body(), error.status)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # chunked upload: the handler's body read fails with 413
                raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)


class CountResponses:
    """`counter{route, status}` += 1 per response; routes outside `routes` count as `other`."""

    def __init__(self, app: ASGIApp, counter: Counter, routes: Collection[str]) -> None:
        self.app, self.counter, self.routes = app, counter, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
