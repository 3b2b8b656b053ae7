"""Deadlines for slow clients: a request's line and headers, then its body.

uvicorn's own timeout covers only the idle time between requests of a keep-alive connection;
a client that trickles its headers a byte at a time holds its connection for as long as it
likes. `header_deadline_protocol(s)` is uvicorn's h11 protocol with one more timer: from the
moment a connection opens (or its previous response ends), the request line and headers must
have arrived within `s` seconds, or the connection is closed. `BodyDeadline` is ASGI
middleware that fails the handler's body read with `BodyTimeout` when the body has not arrived
`s` seconds after the headers; `body_timeout_response` is the 408 an app answers it with.
"""

from __future__ import annotations

import asyncio
import time

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyTimeout(Exception):
    """A request's body did not arrive in time."""


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header deadline of `timeout_s` seconds."""

    class HeaderDeadline(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers get their own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.debug("closing a connection without headers after %s s", timeout_s)
                self.transport.close()  # IDLE: no complete request line + headers yet

    return HeaderDeadline


class BodyDeadline:
    """Answer 408 when a request's body takes over `timeout_s` seconds after its headers."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:  # later receives wait for the disconnect: no deadline on those
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                message = f"the request body did not arrive within {self.timeout_s} s"
                raise BodyTimeout(message) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed, send)


async def body_timeout_response(_: Request, exc: Exception) -> JSONResponse:
    """The 408 (an OpenAI error object) for a `BodyTimeout`; the connection is then closed."""
    body = {
        "error": {
            "message": str(exc),
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
    return JSONResponse(body, 408, headers={"Connection": "close"})
