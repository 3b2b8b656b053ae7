"""`kvabi router`: the OpenAI-compatible front door of a disaggregated deployment.

Each generation request goes to a decode instance with the prefill instance it should fetch
the prompt's KV from (named by its KV endpoint in `X-Kvabi-Prefill`); the decode instance
fetches, decodes and streams, and the router passes the bytes through. Without prefill
instances the "decode" instances are plain colocated `kvabi serve` instances.
Both choices go round robin; with instances that publish KV events (`kv_events`), each goes
to the instance holding the longest prefix of the request, then the least loaded one
(`prefix_routing.py`). `X-Kvabi-Cached-Tokens` tells how much the chosen instance held.
Faults: a decode instance that cannot be reached, fails with a 5xx, or drops a non-streamed
request before its answer is retried on the next one; when none is left the request goes to a
prefill instance, which is a whole engine and serves it colocated. A streamed answer cut after
its first bytes ends with an error event (its text so far was already delivered). A prefill
instance that fails costs nothing here: the decode instance then prefills the prompt itself.
Health: every `health_interval_s` the router asks each instance's /health; one that does not
answer 200 is tried after the healthy ones, and a prefill instance is named as a peer only
while it is healthy (with none healthy the header says `none` and decode instances prefill
locally at once, instead of waiting out a transfer timeout on a frozen peer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvabi.routing.prefix_routing import EventSource, PrefixRouting
from kvabi.routing.prompt_hashing import PromptHashing

log = logging.getLogger("kvabi.router")
PEER_HEADER = "x-kvabi-prefill"
NO_PEER = "none"  # PEER_HEADER's value when no prefill instance is healthy: prefill locally
INSTANCE_HEADER = "x-kvabi-instance"  # the instance that served the request
RETRIES_HEADER = "x-kvabi-retries"  # instances that failed it first
CACHED_HEADER = "x-kvabi-cached-tokens"  # the prompt's tokens the instance held, per its events
PASSED_HEADERS = ("content-type", "x-kvabi-kv", "retry-after", "cache-control")


@dataclass(frozen=True)
class PrefillTarget:
    url: str  # its OpenAI server (for the colocated fallback)
    kv_address: str  # its KV endpoint, which decode instances fetch from


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[PrefillTarget, ...]
    decode: tuple[str, ...]  # decode instances' server URLs
    timeout_s: float = 600.0  # a whole answer
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 4 * 2**20
    kv_events: tuple[EventSource, ...] = ()  # instances whose KV events the router follows
    health_interval_s: float = 2.0  # how often every instance's /health is asked
    health_timeout_s: float = 2.0  # an instance slower than this to answer is unhealthy
    hashing: PromptHashing = PromptHashing()  # the block-hash scheme of the instances' events

    def __post_init__(self) -> None:
        if not self.decode and not self.prefill:
            raise ValueError("router: give at least one decode or prefill instance")
        known = set(self.decode) | {p.url for p in self.prefill}
        for source in self.kv_events:
            if source.url not in known:
                raise ValueError(f"kv_events: {source.url} is not a decode or prefill instance")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout)
        self.routing = PrefixRouting(config.kv_events, self.client, config.hashing)
        self._turn = itertools.count()
        self.statuses: dict[str, int] = {}  # url -> its last /health status (0: no answer)

    def is_healthy(self, url: str) -> bool:
        """As of the last check (an instance not checked yet counts as healthy)."""
        return self.statuses.get(url, 200) == 200

    def candidates(self, cached: dict[str, int] | None = None) -> list[tuple[str, dict[str, str]]]:
        """Where to try a request, in order: each decode instance with a prefill peer to fetch
        from, then the prefill instances as colocated engines; healthy ones first, then by
        `cached` tokens, then load, then round robin."""
        cached, turn = cached or {}, next(self._turn)
        decode = self._healthy_first(self.routing.order(self.config.decode, turn, cached))
        by_url = {p.url: p for p in self.config.prefill}
        order = self._healthy_first(self.routing.order(list(by_url), turn, cached))
        prefill = [by_url[u] for u in order]
        headers = {}
        if prefill:
            peer = prefill[0].kv_address if self.is_healthy(prefill[0].url) else NO_PEER
            headers = {PEER_HEADER: peer}
        return [(url, headers) for url in decode] + [(p.url, {}) for p in prefill]

    def _healthy_first(self, urls: list[str]) -> list[str]:
        return sorted(urls, key=lambda u: not self.is_healthy(u))  # stable: keeps the order

    async def check_health(self) -> dict[str, int]:
        """Ask every instance's /health now (concurrently) and remember the answers."""
        urls = [*self.config.decode, *(p.url for p in self.config.prefill)]
        codes = await asyncio.gather(*(self._status(u) for u in urls))
        self.statuses = dict(zip(urls, codes, strict=True))
        return self.statuses

    async def watch_health(self) -> None:
        """`check_health` every `health_interval_s`, until cancelled."""
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_interval_s)

    async def _status(self, url: str) -> int:
        try:
            r = await self.client.get(url + "/health", timeout=self.config.health_timeout_s)
        except httpx.TransportError:
            return 0
        return r.status_code

    async def forward(self, request: Request, path: str) -> Response:
        """POST the request to the first candidate that serves it (see the module doc)."""
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            return _error(413, f"request body over {self.config.max_body_bytes} bytes")
        headers = {k: v for k, v in request.headers.items() if k in ("authorization",)}
        headers["content-type"] = "application/json"
        is_stream = _is_stream(body)
        cached = (
            await self.routing.cached_tokens(path, body, headers) if self.routing.sources else {}
        )
        failures = []
        for url, extra in self.candidates(cached):
            self.routing.in_flight[url] += 1
            done = partial(self._done, url)
            try:
                response = await self._try(url + path, body, headers | extra, is_stream, done)
            except _Retry as exc:
                done()
                log.warning("%s failed (%s); trying the next instance", url, exc)
                failures.append(f"{url}: {exc}")
                continue
            response.headers[INSTANCE_HEADER] = url
            response.headers[RETRIES_HEADER] = str(len(failures))
            response.headers[CACHED_HEADER] = str(cached.get(url, 0))
            return response
        return _error(503, "no instance could serve the request: " + "; ".join(failures))

    def _done(self, url: str) -> None:
        self.routing.in_flight[url] -= 1

    async def _try(
        self, url: str, body: bytes, headers: dict, is_stream: bool, done: Callable[[], None]
    ) -> Response:
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", url, content=body, headers=headers), stream=True
            )
        except httpx.TransportError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        if upstream.status_code >= 500:
            await upstream.aclose()
            raise _Retry(f"HTTP {upstream.status_code}")
        passed = {k: v for k, v in upstream.headers.items() if k in PASSED_HEADERS}
        if not is_stream or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.TransportError as exc:
                raise _Retry(f"dropped before its answer: {exc}") from exc
            finally:
                await upstream.aclose()
            done()
            return Response(content, upstream.status_code, passed)
        return StreamingResponse(_relay(upstream, done), upstream.status_code, passed)

    async def get(self, path: str) -> Response:
        """GET passed to the first instance that answers (/v1/models)."""
        for url, _ in self.candidates():
            try:
                r = await self.client.get(url + path)
                return Response(r.content, r.status_code, {"content-type": "application/json"})
            except httpx.TransportError:
                continue
        return _error(503, "no instance answers")

    async def health(self) -> JSONResponse:
        """ok when some decode instance (or, failing that, a prefill instance) is healthy."""
        status = await self.check_health()
        ok = any(code == 200 for code in status.values())
        body = {"status": "ok" if ok else "no instance", "instances": status}
        if self.routing.sources:
            body["kv_blocks"] = self.routing.index.num_blocks()  # per instance, from its events
        return JSONResponse(body, 200 if ok else 503)


class _Retry(Exception):
    """This instance failed before anything reached the client; try another."""


async def _relay(upstream: httpx.Response, done: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.warning("a streamed answer was cut: %s", exc)
        error = {
            "error": {
                "message": f"the decode instance failed mid-answer: {exc}",
                "type": "server_error",
                "code": "instance_failed",
            }
        }
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        done()
        await upstream.aclose()


def _is_stream(body: bytes) -> bool:
    try:
        return bool(json.loads(body).get("stream"))
    except (ValueError, AttributeError):
        return False  # the instance answers a bad body with its own error


def _error(status: int, message: str) -> JSONResponse:
    code = "no_instance" if status == 503 else None
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return JSONResponse(body, status)


def create_router_app(config: RouterConfig) -> FastAPI:
    """The router's app: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    router = Router(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.routing.start()
        watcher = asyncio.create_task(router.watch_health())
        try:
            yield
        finally:
            watcher.cancel()
            router.routing.close()
            await router.client.aclose()

    app = FastAPI(title="kvabi router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.get("/v1/models")

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    return app
