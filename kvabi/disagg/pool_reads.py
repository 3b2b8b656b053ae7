"""A decode instance's fetch without a copy: the peer's pool blocks READ straight into blocks
reserved in ours (NIXL, both pools of one descriptor), then indexed as cached blocks.

The engine thread reserves free blocks for the prompt's blocks from the fetch's start (the
pooled prefix pinned meanwhile), a worker thread has the transport READ the peer's lent blocks
into them and verify every checksum, and the engine thread then indexes them (`commit`): until
then nothing can hit them. Any failure frees them unindexed (`cancel`), except a READ that
could not be cancelled (`NixlReadAbandoned`): those blocks may still be written, so they are
never given back. A request cancelled meanwhile frees them once the READ has ended.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvabi.cache.kv_cache import BlockReservation, ImportResult
from kvabi.engine.async_engine import AsyncEngine
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.nixl_read import NixlReadAbandoned
from kvabi.transfer.transport import FetchRequest, KVClient, KVPayload

log = logging.getLogger("kvabi.server")


@dataclass(frozen=True)
class PoolRead:
    """What `read_into_pool` did: `result` of placing the blocks (None: they would not extend
    the pooled prefix, and nothing was asked of the peer), and whether they were READ straight
    into the pool (`is_direct`; False: the peer could not lend them and sent a copy)."""

    result: ImportResult | None
    is_direct: bool = False


async def read_into_pool(
    engine: AsyncEngine, client: KVClient, request: FetchRequest, num_blocks: int
) -> PoolRead:
    """Fetch `num_blocks` blocks from `request.start_token` into the pool."""
    ids, salt, start = request.token_ids, request.cache_salt, request.start_token
    reservation = await engine.call(lambda e: e.cache.reserve(ids, salt, start, num_blocks))
    if reservation is None:
        return PoolRead(None)
    read = asyncio.ensure_future(asyncio.to_thread(client.fetch_into, request, reservation))
    try:
        landed = await asyncio.shield(read)
    except asyncio.CancelledError:
        read.add_done_callback(lambda _: _cancel_later(engine, read, reservation))
        raise
    except NixlReadAbandoned:
        log.error("a READ into %d pool blocks could not be cancelled: they stay taken", num_blocks)
        raise
    except BaseException:
        await engine.call(lambda e: e.cache.cancel(reservation))
        raise
    if landed.payload is not None:  # the peer could not lend: place a copy as any fetch's
        await engine.call(lambda e: e.cache.cancel(reservation))
        return PoolRead(await import_payload(engine, ids, salt, landed.payload))
    result = await engine.call(lambda e: e.cache.commit(reservation, landed.num_blocks))
    return PoolRead(result, is_direct=True)


async def import_payload(
    engine: AsyncEngine, ids: tuple[int, ...], salt: str | None, payload: KVPayload
) -> ImportResult:
    """Place a fetched payload: restaged off the engine thread, then imported on it."""
    desc = engine.engine.info.descriptor
    payload = await asyncio.to_thread(stage_payload, payload, desc)
    return await engine.call(lambda e: e.cache.import_blocks(ids, salt, payload))


def _cancel_later(engine: AsyncEngine, read: asyncio.Future, reservation: BlockReservation) -> None:
    """The READ of a cancelled request has ended: free its blocks (unless it was abandoned)."""
    if not read.cancelled() and isinstance(read.exception(), NixlReadAbandoned):
        return
    engine.call(lambda e: e.cache.cancel(reservation))
