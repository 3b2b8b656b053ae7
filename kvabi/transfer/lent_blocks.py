"""The decode side of a loan (nixl_server.py): check the `blocks` reply, READ the lent blocks
where they land (`Landing`), answer `done`, then verify every buffer's checksum (the peer's
`sums` message, sent while we READ) over the blocks they landed in.

Lent blocks land straight in the blocks reserved in our pool when it has the peer's
descriptor. Otherwise they land in registered staging buffers of the peer's descriptor, and
each part, once READ, is converted layer by layer into the reserved blocks while the next part
is READ (conversion while receiving).

The reply is refused before any READ unless it is exactly what was asked: the asked start, the
prompt's own block hashes (so the asked tokens), buffers of the landing's geometry, block ids
inside the peer's buffers, no more blocks than there is room for (`fetch_into` asks no more).
A checksum mismatch after the READ raises `ChecksumError`: the caller must not index those
blocks. A READ that timed out and could not be cancelled raises `NixlReadAbandoned`: the
reserved blocks may still be written and must never be reused.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Any

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.cache.kv_cache import BlockReservation, FetchRequest
from kvabi.transfer.errors import TransferError
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.nixl_read import nixl_read_extents
from kvabi.transfer.pool_regions import PoolRegion, block_sums, paired_runs, read_extents
from kvabi.wire.errors import ChecksumError, FormatError

NUM_PARTS = 4  # READs per loan: one part is checksummed and placed while the next is READ
PART_BYTES = 4 * 2**20  # ... each of at least this many bytes (a small loan is one READ)


@dataclass(frozen=True)
class Landing:
    """Where lent blocks land: blocks `block_ids` of `buffers` (registered: `regions`), in
    the peer's descriptor. `place(layer_ids, num_blocks)`, if given, then moves those layers
    of the first `num_blocks` landed blocks on into the pool (a conversion); without it they
    landed in the pool itself."""

    buffers: CacheBuffers
    regions: list[PoolRegion]
    block_ids: tuple[int, ...]
    place: Callable[[list[int], int], None] | None = None

    def take(self, keys: list[str], num_blocks: int) -> dict[str, int]:
        """A landed part's checksums, then its placement (on the worker: off the READs)."""
        sums = block_sums(self.buffers, self.block_ids[:num_blocks], keys)
        if self.place is not None:
            specs = buffer_specs(self.buffers.desc, self.buffers.extent)
            layers = sorted({i for s in specs if s.key in keys for i in s.layer_ids})
            self.place(layers, num_blocks)
        return sums


def converting_landing(
    staging: CacheBuffers, regions: list[PoolRegion], reservation: BlockReservation
) -> Landing:
    """Land in `staging` (the peer's layout, blocks 0, 1, ...), then convert each part's
    layers into the reservation's blocks."""
    own = reservation.buffers

    def place(layer_ids: list[int], num_blocks: int) -> None:
        num_tokens = num_blocks * staging.desc.layout.block_size
        dst_ids = reservation.block_ids[: num_tokens // own.desc.layout.block_size]
        convert(
            staging, own.desc, num_tokens=num_tokens, src_block_ids=list(range(num_blocks)),
            dst_block_ids=dst_ids, out=own, layer_ids=layer_ids,
        )  # fmt: skip

    return Landing(staging, regions, tuple(range(staging.extent)), place)


def read_lent(
    conn: socket.socket,
    agent: Any,  # noqa: ANN401 - a nixl_agent
    peer_agent: str,
    reply: dict,
    request: FetchRequest,
    expected: list[bytes],  # our hashes of the prompt's blocks of the peer's size from start
    landing: Landing,
    timeout_s: float,
    worker: Executor,
) -> int:
    """READ the blocks `reply` lends into `landing`; how many. The READ goes in up to
    `NUM_PARTS` transfers; each part is checksummed and placed on `worker` while the next is
    READ."""
    src_ids, regions = _checked(reply, request, expected, landing)
    own, n = landing.regions, len(src_ids)
    runs = paired_runs(src_ids, landing.block_ids[:n])
    num_bytes = n * sum(r.block_bytes * len(r.offsets) for r in own)
    num_parts = max(1, min(NUM_PARTS, num_bytes // PART_BYTES))
    step, parts = -(-len(own) // num_parts), []
    try:
        for lo in range(0, len(own) if n else 0, step):
            part = slice(lo, lo + step)
            extents = read_extents(regions[part], own[part], runs)
            nixl_read_extents(agent, peer_agent, extents, timeout_s)
            parts.append(worker.submit(landing.take, [r.key for r in own[part]], n))
        send_msg(conn, {"t": "done"})  # the peer may release its blocks now
        sums = _sums(expect(recv_msg(conn), "sums").get("sums"), len(own))
    finally:
        wait(parts)  # nothing may still write the landing once the caller frees it
    landed = {k: v for part in parts for k, v in part.result().items()}
    landed = landed if parts else block_sums(landing.buffers, [])
    bad = [r.key for r, s in zip(own, sums, strict=True) if landed[r.key] != s]
    if bad:
        raise ChecksumError(f"lent blocks: buffers {bad[:4]} do not match the peer's checksums")
    return n


def _checked(
    reply: dict, request: FetchRequest, expected: list[bytes], landing: Landing
) -> tuple[list[int], list[PoolRegion]]:
    ids, hashes = reply.get("block_ids"), reply.get("block_hashes")
    if reply.get("start_token") != request.start_token:
        raise TransferError(
            f"blocks for start {reply.get('start_token')!r}, asked {request.start_token}"
        )
    if not isinstance(ids, list) or not all(isinstance(b, int) and b >= 0 for b in ids):
        raise TransferError("blocks: block_ids must be a list of block numbers")
    if len(ids) > len(landing.block_ids):
        raise TransferError(f"blocks: {len(ids)} lent, room for {len(landing.block_ids)}")
    block_size = landing.buffers.desc.layout.block_size
    if reply.get("num_tokens") != len(ids) * block_size or hashes != expected[: len(ids)]:
        raise FormatError("the lent blocks are not the prompt's (tokens or block hashes)")
    return ids, _regions(reply.get("regions"), landing.regions, ids)


def _regions(msg: object, own: list[PoolRegion], ids: list[int]) -> list[PoolRegion]:
    if not isinstance(msg, list) or len(msg) != len(own):
        raise TransferError("blocks: the peer's pool has other buffers than ours")
    regions = [PoolRegion.from_msg(m) for m in msg]
    for theirs, ours in zip(regions, own, strict=True):
        if not theirs.matches(ours):
            raise TransferError(f"blocks: the peer's buffer {theirs.key!r} is not shaped as ours")
        if ids and max(ids) >= theirs.num_blocks:
            raise TransferError(f"blocks: a block id past the peer's {theirs.num_blocks} blocks")
    return regions


def _sums(msg: object, num_buffers: int) -> list[int]:
    if not isinstance(msg, list) or len(msg) != num_buffers:
        raise TransferError("blocks: one checksum per buffer expected")
    if not all(isinstance(s, int) for s in msg):
        raise TransferError("blocks: checksums must be integers")
    return msg
