"""The server's part in disaggregation: a prefill instance serves prompts' KV on its KV
endpoint; a decode instance fetches it before it admits a request (kvabi/disagg).

Prefill: a fetch arrives on a transport thread; the prompt is admitted like any request with
`max_tokens=1` (so it is batched with the others). With a transport that streams layers (tcp),
the step that completes the prompt copies each layer's blocks out as soon as the forward has
stored them (`PromptFeeds`, the engine's `on_prompt_layer` hook, given when the engine is
built: `kvabi.server.app.server_hooks`), and the transport's thread sends that layer while the
forward computes the next; otherwise the pooled blocks are copied out when it ends
(`KVCache.export`).
Decode: before a request is queued, the cache is asked what it already holds (pool, then
tiers), the rest is fetched from the named prefill peer and imported into the pool as cached
blocks (engine thread); the request then hits them. Any failure of that path
(peer gone, timeout, checksum, refusal) only means the decode instance prefills the prompt
itself: the request is served either way, and its `X-Kvabi-KV` header says which way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from kvabi.abi.buffers import CacheBuffers, owner_layers
from kvabi.cache.kv_cache import KVCache
from kvabi.disagg.pool_reads import import_payload, read_into_pool
from kvabi.disagg.settings import DisaggSettings
from kvabi.engine.async_engine import AsyncEngine
from kvabi.engine.request_handle import EngineError, RequestHandle
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.sequence import Sequence
from kvabi.routing.router import NO_PEER
from kvabi.transfer.errors import RemoteError, TransferError
from kvabi.transfer.kv_staging import fetch_start
from kvabi.transfer.layer_feed import LayerFeed
from kvabi.transfer.peer_backoff import PeerBackoff
from kvabi.transfer.transport import (
    FetchRequest,
    KVClient,
    KVLoan,
    KVPayload,
    KVServer,
    KVStream,
    StreamProvider,
)

log = logging.getLogger("kvabi.server")
PEER_HEADER = "x-kvabi-prefill"  # the router names the prefill peer to fetch from
KV_HEADER = "x-kvabi-kv"  # where a decode response's prompt KV came from


class PromptFeeds:
    """The engine's `on_prompt_layer` hook on a prefill instance: the prompts being streamed
    (request id -> its layer feed and the blocks it sends), each fed a layer as it is stored."""

    def __init__(self) -> None:
        self._feeds: dict[str, tuple[LayerFeed, slice]] = {}
        self._lock = threading.Lock()  # the engine thread reads, the event loop registers

    def add(
        self, submit: Callable[[], RequestHandle], feed: LayerFeed, blocks: slice
    ) -> RequestHandle:
        """Submit a prompt and register its feed under one lock: the engine thread cannot
        reach the prompt's layers before its feed is known."""
        with self._lock:
            handle = submit()
            self._feeds[handle.request_id] = (feed, blocks)
        return handle

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._feeds.pop(request_id, None)

    def __call__(self, cache: KVCache, layer_id: int, seqs: tuple[Sequence, ...]) -> None:
        """On the engine thread, mid-forward: copy this layer of each streamed prompt's blocks
        (a few memcpys) and hand it to its sender, then let the forward go on."""
        for seq in seqs:
            with self._lock:
                entry = self._feeds.get(seq.request_id)
            if entry is None:
                continue
            feed, blocks = entry
            try:
                feed.put(layer_id, cache.export_layer(layer_id, seq.block_tables, blocks))
            except Exception as exc:  # never fail the engine's step for one transfer
                feed.fail(exc)


class PrefillRole:
    def __init__(self, settings: DisaggSettings, engine: AsyncEngine) -> None:
        self.settings, self.engine = settings, engine
        self.server: KVServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        hook = engine.engine.hooks.on_prompt_layer
        self._feeds = hook if isinstance(hook, PromptFeeds) else None  # None: no streaming

    def start(self) -> None:
        """Listen on the KV endpoint; call from the event loop, after the engine started."""
        self._loop = asyncio.get_running_loop()
        desc, cache = self.engine.engine.info.descriptor, self.engine.engine.cache
        transport = self.settings.make_transport()
        provider: StreamProvider = self._provide
        if transport.streams_layers and self._feeds is not None:
            provider = self._provide_stream
        lent = cache.lent_buffers  # NIXL peers READ its blocks straight out of the pool
        self.server = transport.listen(self.settings.kv_address, desc, provider, lent)
        log.info("prefill KV endpoint on %s", self.server.address)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    def _provide(self, request: FetchRequest) -> KVPayload | KVLoan:
        """On a transport thread: prefill on the engine, then export (or, to a fetch that
        reads blocks, lend them); bounded by the timeout."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._prefill(request), self._loop)
        try:
            return future.result(self.settings.transfer_timeout_s)
        except BaseException:
            future.add_done_callback(_release_late)  # a loan made past the timeout goes back
            raise
        finally:
            future.cancel()  # past the timeout: abort the prefill (no-op once done)

    async def _prefill(self, request: FetchRequest) -> KVPayload | KVLoan:
        ids = self.engine.engine.prompt_ids(list(request.token_ids))  # checks, as a request's
        params = SamplingParams(max_tokens=1, temperature=0, cache_salt=request.cache_salt)
        handle = self.engine.submit(ids, params)
        try:
            async for out in handle.updates():
                if out.finished:
                    break
        finally:
            self.engine.abort(handle)  # no-op once finished
        ids, salt, start = request.token_ids, request.cache_salt, request.start_token
        if request.reads_blocks and self.engine.engine.cache.lends_blocks:
            lent = self.engine.call(lambda engine: engine.cache.lend(ids, salt, start))
            try:
                loan = await asyncio.shield(lent)
            except asyncio.CancelledError:  # the fetch gave up: the loan, once made, goes back
                lent.add_done_callback(lambda f: f.exception() or self._release(f.result()))
                raise
            return replace(loan, release=lambda: self._release(loan))
        return await self.engine.call(lambda engine: engine.cache.export(ids, salt, start))

    def _release(self, loan: KVLoan) -> None:
        """A loan's release, from a transport thread: on the engine thread, not waited for."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.engine.call, lambda _: loan.release())

    def _provide_stream(self, request: FetchRequest) -> KVPayload | KVStream | KVLoan:
        """On a transport thread: the prompt's full blocks from `start_token` on, each layer
        as the forward stores it (`_layer_stored`); nothing to send runs no prefill."""
        assert self._loop is not None
        engine = self.engine.engine
        if request.reads_blocks and engine.cache.lends_blocks:
            return self._provide(request)  # lent once the prefill is done, not streamed
        desc, ids = engine.info.descriptor, engine.prompt_ids(list(request.token_ids))
        bs, salt = desc.layout.block_size, request.cache_salt
        blocks = slice(request.start_token // bs, len(ids) // bs)
        if blocks.start >= blocks.stop:
            return KVPayload(request.start_token, (), (), CacheBuffers.empty(desc, 0))
        hashes = engine.cache.hasher.hashes(ids, salt)[blocks]  # the hasher is pure
        feed = LayerFeed(owner_layers(desc), self.settings.transfer_timeout_s)
        future = asyncio.run_coroutine_threadsafe(self._stream(ids, salt, feed, blocks), self._loop)
        feed.on_abandon = future.cancel  # the sender gave up: abort the prefill
        tokens = tuple(ids[blocks.start * bs : blocks.stop * bs])
        return KVStream(request.start_token, tokens, tuple(hashes), desc, feed.layers())

    async def _stream(
        self, ids: list[int], salt: str | None, feed: LayerFeed, blocks: slice
    ) -> None:
        params = SamplingParams(max_tokens=1, temperature=0, cache_salt=salt)
        handle = None
        try:
            handle = self._feeds.add(lambda: self.engine.submit(ids, params), feed, blocks)
            async for out in handle.updates():
                if out.finished:
                    break
            if not feed.is_complete:
                feed.fail(TransferError("the prefill ended before every layer was stored"))
        except BaseException as exc:
            feed.fail(TransferError(f"the prefill failed: {exc!r}"))
            raise
        finally:
            if handle is not None:
                self._feeds.remove(handle.request_id)
                self.engine.abort(handle)  # no-op once finished


def _release_late(future: concurrent.futures.Future) -> None:
    """Release a loan nobody will send (its fetch gave up before it was made)."""
    if not future.cancelled() and future.exception() is None:
        answer = future.result()
        if isinstance(answer, KVLoan):
            answer.release()


class DecodeRole:
    def __init__(self, settings: DisaggSettings, engine: AsyncEngine) -> None:
        self.settings, self.engine = settings, engine
        self.clients: dict[str, KVClient] = {}
        self.outcomes: Counter[str] = Counter()
        self.backoff = PeerBackoff(settings.peer_max_failures, settings.peer_cooldown_s)
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
        value): `prefill;tokens=N` (N tokens the pool now holds, some fetched; with
        `;via=pool-read` when they were READ straight from the peer's pool), `pool;tokens=N`
        (the pool already held every block a fetch could bring), or `local;reason=...` when
        this instance computes it (a failure, a short prompt, no peer, a peer backed off)."""
        address = peer or (self.settings.peers[0] if self.settings.peers else None)
        if address == NO_PEER:
            return self._count("local;reason=no-peer")
        if address not in self.settings.peers:
            return self._count(f"local;reason=unknown-peer {address}")
        if self.backoff.is_skipped(address):
            return self._count("local;reason=peer-backed-off")
        try:
            outcome = await self._pull(address, tuple(prompt_ids), params.cache_salt)
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.warning("KV fetch from %s failed, prefilling here: %s", address, exc)
            if not isinstance(exc, RemoteError):  # the peer answered: it is not what failed
                self.backoff.failed(address)
            return self._count(f"local;reason={type(exc).__name__}")
        if outcome.startswith("prefill;"):  # the peer delivered (else it was not asked)
            self.backoff.succeeded(address)
        return self._count(outcome)

    async def _pull(self, address: str, ids: tuple[int, ...], salt: str | None) -> str:
        client = await self._client(address)
        cache = self.engine.engine.cache
        keys = cache.hasher.keys(ids, salt)  # pure: off the engine thread
        held = await self.engine.call(lambda e: e.cache.held(keys)) * cache.block_size
        own_bs = cache.block_size
        peer_bs = client.peer_desc.layout.block_size
        start = fetch_start(held, own_bs, peer_bs)
        asked = ids
        if not cache.plan.is_uniform:  # a window's blocks hold for the end they were sent for
            asked = ids[: fetch_start(len(ids), own_bs, peer_bs)]  # so end on both boundaries
        sent = (len(asked) - start) // peer_bs * peer_bs  # the peer sends whole blocks of its size
        if start + sent // own_bs * own_bs <= held:  # of which we place whole blocks of ours
            return f"pool;tokens={held}" if held else "local;reason=short-prompt"
        request, desc = FetchRequest(asked, start, salt), self.engine.engine.info.descriptor
        via = ""
        if cache.lends_blocks and client.can_read_blocks(desc):  # pool to pool, no copy
            read = await read_into_pool(self.engine, client, request, sent // own_bs)
            result, via = read.result, ";via=pool-read" if read.is_direct else ""
        else:
            payload = await asyncio.to_thread(client.fetch, request)
            result = await import_payload(self.engine, ids, salt, payload)
        if result is None or result.num_cached_tokens <= held:
            return f"pool;tokens={held}" if held else "local;reason=nothing-fetched"
        return f"prefill;tokens={result.num_cached_tokens}{via}"

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
