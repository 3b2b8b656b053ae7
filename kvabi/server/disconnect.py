"""A client that goes away stops its work: both response kinds notice the disconnect.

Streamed: `EventStream` calls its `on_close` (which aborts the request; a no-op once it finished)
however the response ends: finished, client gone, task cancelled, or never started. Not streamed:
`cancel_on_disconnect` races the result against the client's `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


class EventStream(StreamingResponse):
    """Server-sent events, with `on_close()` called whenever the response ends."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events, self._on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # before any await: one here may be cancelled with the response
            await self._events.aclose()  # type: ignore[attr-defined]


async def cancel_on_disconnect(request: Request, result: Awaitable[T]) -> T:
    """Await `result` unless the client disconnects first (then ClientDisconnected)."""
    work = asyncio.ensure_future(result)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        work.cancel()  # no-op when done; else the client is gone or this handler was cancelled


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
