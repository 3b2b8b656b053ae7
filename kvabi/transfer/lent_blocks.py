"""The decode side of a loan (nixl_server.py): check the `blocks` reply, READ the lent blocks
straight into the reserved ones of our pool, answer `done`, then verify every buffer's
checksum (the peer's `sums` message, sent while we READ) over the blocks they landed in.

The reply is refused before any READ unless it is exactly what was asked: the asked start, the
prompt's own block hashes (so the asked tokens), buffers of our descriptor's geometry, block ids
inside the peer's buffers, no more blocks than were reserved (`fetch_into` asks for no more).
A checksum mismatch after the READ raises `ChecksumError`: the caller must not index those
blocks. A READ that timed out and could not be cancelled raises `NixlReadAbandoned`: the
reserved blocks may still be written and must never be reused.
"""

from __future__ import annotations

import socket
from concurrent.futures import Executor
from typing import Any

from kvabi.cache.kv_cache import BlockReservation, FetchRequest
from kvabi.transfer.errors import TransferError
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.nixl_read import nixl_read_extents
from kvabi.transfer.pool_regions import PoolRegion, block_sums, paired_runs, read_extents
from kvabi.wire.errors import ChecksumError, FormatError

NUM_PARTS = 4  # READs per loan: the checksums of one part are taken while the next is READ


def read_lent(
    conn: socket.socket,
    agent: Any,  # noqa: ANN401 - a nixl_agent
    peer_agent: str,
    reply: dict,
    request: FetchRequest,
    expected: list[bytes],  # our hashes of the prompt's blocks from the start
    reservation: BlockReservation,
    own: list[PoolRegion],  # our pool's regions, registered with `agent`
    timeout_s: float,
    verifier: Executor,
) -> int:
    """READ the blocks `reply` lends into the reservation's first ones; how many. The READ
    goes in `NUM_PARTS` transfers; each part's checksums are taken on `verifier` while the
    next part is READ."""
    src_ids, regions = _checked(reply, request, expected, reservation, own)
    dst_ids = reservation.block_ids[: len(src_ids)]
    runs, step, parts = paired_runs(src_ids, dst_ids), -(-len(own) // NUM_PARTS), []
    for lo in range(0, len(own) if src_ids else 0, step):
        part = slice(lo, lo + step)
        extents = read_extents(regions[part], own[part], runs)
        nixl_read_extents(agent, peer_agent, extents, timeout_s)
        keys = [r.key for r in own[part]]
        parts.append(verifier.submit(block_sums, reservation.buffers, dst_ids, keys))
    send_msg(conn, {"t": "done"})  # the peer may release its blocks now
    sums = _sums(expect(recv_msg(conn), "sums").get("sums"), len(own))
    landed = {k: v for part in parts for k, v in part.result().items()}
    landed = landed if parts else block_sums(reservation.buffers, dst_ids)
    bad = [r.key for r, s in zip(own, sums, strict=True) if landed[r.key] != s]
    if bad:
        raise ChecksumError(f"lent blocks: buffers {bad[:4]} do not match the peer's checksums")
    return len(src_ids)


def _checked(
    reply: dict,
    request: FetchRequest,
    expected: list[bytes],
    reservation: BlockReservation,
    own: list[PoolRegion],
) -> tuple[list[int], list[PoolRegion]]:
    ids, hashes = reply.get("block_ids"), reply.get("block_hashes")
    if reply.get("start_token") != request.start_token:
        raise TransferError(
            f"blocks for start {reply.get('start_token')!r}, asked {request.start_token}"
        )
    if not isinstance(ids, list) or not all(isinstance(b, int) and b >= 0 for b in ids):
        raise TransferError("blocks: block_ids must be a list of block numbers")
    if len(ids) > len(reservation.block_ids):
        raise TransferError(f"blocks: {len(ids)} lent, {len(reservation.block_ids)} reserved")
    block_size = reservation.buffers.desc.layout.block_size
    if reply.get("num_tokens") != len(ids) * block_size or hashes != expected[: len(ids)]:
        raise FormatError("the lent blocks are not the prompt's (tokens or block hashes)")
    return ids, _regions(reply.get("regions"), own, ids)


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
