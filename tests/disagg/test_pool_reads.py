"""The decode side's pool-to-pool fetch around the transport (kvabi/disagg/pool_reads.py):
reserved blocks are indexed only after a fetch that verified them, freed unindexed after any
failure, and freed only once the READ has ended when the request is cancelled meanwhile. The
transport is a stand-in at the `KVClient` seam; the real NIXL path is in tests/transfer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvabi.cache.kv_cache import BlockReservation
from kvabi.disagg.pool_reads import read_into_pool
from kvabi.engine.async_engine import AsyncEngine
from kvabi.transfer.transport import FetchRequest, KVClient, KVPayload, Landed
from kvabi.wire.errors import ChecksumError
from tests.disagg.tiny_peers import engine

PROMPT = tuple(range(3, 24))  # 5 whole blocks of 4


class StandIn(KVClient):
    """Lands `num_blocks` (or raises `error`), after `gate` opens if given."""

    def __init__(self, num_blocks: int = 5, error: Exception | None = None) -> None:
        self.num_blocks, self.error = num_blocks, error
        self.gate: threading.Event | None = None
        self.seen: list[tuple[int, ...]] = []

    def fetch(self, request: FetchRequest) -> KVPayload:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def fetch_into(self, request: FetchRequest, reservation: BlockReservation) -> Landed:
        self.seen.append(reservation.block_ids)
        if self.gate is not None:
            self.gate.wait(5)
        if self.error is not None:
            raise self.error
        return Landed(self.num_blocks)


def run(client: StandIn, cancel: bool = False):
    e = engine("nhd", 4)
    async_engine = AsyncEngine(e, max_in_flight=4)

    async def main():
        async_engine.start()
        try:
            task = asyncio.ensure_future(
                read_into_pool(async_engine, client, FetchRequest(PROMPT), 5)
            )
            if cancel:
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                free_while_reading = await async_engine.call(lambda x: x.cache.pool.num_free)
                client.gate.set()
                await asyncio.sleep(0.3)  # the READ ends; its blocks are freed after it
                return free_while_reading
            try:
                read = await task
            except ChecksumError:
                return "checksum"
            assert read.is_direct
            return read.result
        finally:
            await asyncio.to_thread(async_engine.stop)

    result = asyncio.run(main())
    return result, e


def test_verified_blocks_are_indexed():
    client = StandIn()
    result, e = run(client)
    assert client.seen == [(0, 1, 2, 3, 4)]
    assert (result.num_cached_tokens, result.num_placed_blocks) == (20, 5)
    assert (
        e.cache.num_pooled(e.cache.hasher.hashes(PROMPT, None)) == 5 and e.cache.pool.num_free == 64
    )


def test_a_failed_fetch_frees_the_reserved_blocks_unindexed():
    result, e = run(StandIn(error=ChecksumError("a buffer does not match")))
    assert result == "checksum"
    assert (e.cache.pool.num_free, e.cache.pool.num_cached) == (64, 0)


def test_a_cancelled_request_frees_its_blocks_only_after_the_read():
    client = StandIn()
    client.gate = threading.Event()
    free_while_reading, e = run(client, cancel=True)
    assert free_while_reading == 59  # the READ may still write them: still taken
    assert (e.cache.pool.num_free, e.cache.pool.num_cached) == (64, 0)
