"""The server's part in disaggregation: a prefill instance serves prompts' KV on its KV
endpoint; a decode instance fetches it before it admits a request (kvabi/disagg).

Prefill: a fetch arrives on a transport thread; the prompt is admitted like any request with
`max_tokens=1` (so it is batched with the others), and when it ends its pooled blocks are
copied out on the engine thread and sent. Decode: before a request is queued, the pool is
asked what it already holds, the rest is fetched from the named prefill peer and placed in the
pool as cached blocks (engine thread); the request then hits them. Any failure of that path
(peer gone, timeout, checksum, refusal) only means the decode instance prefills the prompt
itself: the request is served either way, and its `X-Kvabi-KV` header says which way.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvabi.disagg.kv_export import export_blocks
from kvabi.disagg.kv_inject import fetch_start, inject_blocks, num_held_tokens, stage_payload
from kvabi.disagg.settings import DisaggSettings
from kvabi.disagg.transport import FetchRequest, KVClient, KVPayload, KVServer
from kvabi.engine.sampling_params import SamplingParams
from kvabi.server.async_engine import AsyncEngine
from kvabi.server.request_handle import EngineError

log = logging.getLogger("kvabi.server")
PEER_HEADER = "x-kvabi-prefill"  # the router names the prefill peer to fetch from
KV_HEADER = "x-kvabi-kv"  # where a decode response's prompt KV came from


class PrefillRole:
    def __init__(self, settings: DisaggSettings, engine: AsyncEngine) -> None:
        self.settings, self.engine = settings, engine
        self.server: KVServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listen on the KV endpoint; call from the event loop, after the engine started."""
        self._loop = asyncio.get_running_loop()
        desc = self.engine.engine.info.descriptor
        self.server = self.settings.make_transport().listen(
            self.settings.kv_address, desc, self._provide
        )
        log.info("prefill KV endpoint on %s", self.server.address)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    def _provide(self, request: FetchRequest) -> KVPayload:
        """On a transport thread: prefill on the engine, then export; bounded by the timeout."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._prefill(request), self._loop)
        try:
            return future.result(self.settings.transfer_timeout_s)
        finally:
            future.cancel()  # past the timeout: abort the prefill (no-op once done)

    async def _prefill(self, request: FetchRequest) -> KVPayload:
        ids = self.engine.engine.prompt_ids(list(request.token_ids))  # checks, as a request's
        params = SamplingParams(max_tokens=1, temperature=0, cache_salt=request.cache_salt)
        handle = self.engine.submit(ids, params)
        try:
            async for out in handle.updates():
                if out.finished:
                    break
        finally:
            self.engine.abort(handle)  # no-op once finished
        return await self.engine.call(lambda engine: export_blocks(engine, request))


class DecodeRole:
    def __init__(self, settings: DisaggSettings, engine: AsyncEngine) -> None:
        self.settings, self.engine = settings, engine
        self.clients: dict[str, KVClient] = {}
        self.outcomes: Counter[str] = Counter()
        self._connecting = asyncio.Lock()

    async def start(self) -> None:
        """Connect and handshake with every peer now: an incompatible or unauthenticated peer
        stops the start-up with its typed error; an unreachable one is retried on first use."""
        for address in self.settings.peers:
            try:
                await self._client(address)
            except OSError as exc:
                log.warning("prefill peer %s unreachable at start-up: %s", address, exc)

    def stop(self) -> None:
        for client in self.clients.values():
            client.close()

    async def pull(self, peer: str | None, prompt_ids: list[int], params: SamplingParams) -> str:
        """Fetch and place the prompt's KV; returns where it came from (the `X-Kvabi-KV`
        value): `prefill;tokens=N`, or `local;reason=...` when this instance computes it."""
        address = peer or (self.settings.peers[0] if self.settings.peers else None)
        if address not in self.settings.peers:
            return self._count(f"local;reason=unknown-peer {address}")
        try:
            tokens = await self._pull(address, tuple(prompt_ids), params.cache_salt)
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.warning("KV fetch from %s failed, prefilling here: %s", address, exc)
            return self._count(f"local;reason={type(exc).__name__}")
        return self._count(f"prefill;tokens={tokens}")

    async def _pull(self, address: str, ids: tuple[int, ...], salt: str | None) -> int:
        client = await self._client(address)
        held = await self.engine.call(lambda e: num_held_tokens(e, ids, salt))
        own_bs = self.engine.engine.config.block_size
        start = fetch_start(held, own_bs, client.peer_desc.layout.block_size)
        payload = await asyncio.to_thread(client.fetch, FetchRequest(ids, start, salt))
        desc = self.engine.engine.info.descriptor
        payload = await asyncio.to_thread(stage_payload, payload, desc)  # off the engine thread
        result = await self.engine.call(lambda e: inject_blocks(e, ids, salt, payload))
        return result.num_cached_tokens

    async def _client(self, address: str) -> KVClient:
        async with self._connecting:  # one handshake per peer, however many requests wait
            if address not in self.clients:
                desc = self.engine.engine.info.descriptor
                transport = self.settings.make_transport()
                self.clients[address] = await asyncio.to_thread(transport.connect, address, desc)
        return self.clients[address]

    def _count(self, outcome: str) -> str:
        self.outcomes[outcome.split(";")[0]] += 1
        return outcome
