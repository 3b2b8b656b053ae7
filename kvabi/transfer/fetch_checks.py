"""The checks every transport makes of a fetch: the request on the prefill side, the answer's
identity on the decode side (both the TCP and the NIXL transport use them).
"""

from __future__ import annotations

import socket
import time

from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_hasher import BlockHasher
from kvabi.transfer.errors import (
    MessageTooLargeError,
    PeerClosedError,
    TransferError,
    TransferTimeoutError,
)
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.transport import FetchRequest, TransportConfig
from kvabi.wire.container import Container, ContainerMeta
from kvabi.wire.errors import FormatError

MIN_HEARTBEAT_S = 0.05


def parse_fetch(msg: dict, max_tokens: int, block_size: int) -> FetchRequest:
    """A `fetch` control message as a request, refused unless well-formed and in bounds."""
    ids, start, salt = msg.get("token_ids"), msg.get("start_token"), msg.get("cache_salt")
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:  # C loops: 1k+ ids
        raise TransferError("fetch: token_ids must be a list of ints")
    if len(ids) > max_tokens:
        raise MessageTooLargeError(f"fetch: {len(ids)} tokens > {max_tokens}")
    if not isinstance(start, int) or not 0 <= start <= len(ids):
        raise TransferError(f"fetch: start_token {start!r} outside the prompt")
    if start % block_size:
        raise TransferError(f"fetch: start_token {start} is not at a block boundary")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise TransferError("fetch: cache_salt must be a non-empty string or absent")
    return FetchRequest(tuple(ids), start, salt, msg.get("reads_blocks") is True)


def fetch_msg(request: FetchRequest, heartbeat_s: float) -> dict:
    """The `fetch` control message of `request`; `heartbeat_s`: how often the asker wants a
    `wait` while the peer prefills (a third of its stall timeout)."""
    return {
        "t": "fetch",
        "token_ids": list(request.token_ids),
        "start_token": request.start_token,
        "cache_salt": request.cache_salt,
        "heartbeat_s": heartbeat_s,
        "reads_blocks": request.reads_blocks,
    }


def heartbeat_interval(msg: dict, config: TransportConfig) -> float:
    """How often to say `wait` for this fetch: as the asker asks, within [0.05, ours] s."""
    asked = msg.get("heartbeat_s")
    if not isinstance(asked, int | float) or isinstance(asked, bool) or not asked > 0:
        return config.heartbeat_s
    return min(max(float(asked), MIN_HEARTBEAT_S), config.heartbeat_s)


class ClosedByPeer(PeerClosedError):
    """The peer closed the connection before answering (e.g. an idle connection it dropped):
    the fetch may be retried on a new connection."""


def ask_kv(
    conn: socket.socket,
    request: FetchRequest,
    config: TransportConfig,
    own: Descriptor,
    peer: Descriptor,
) -> tuple[dict, list[bytes]]:
    """Send the `fetch` message and wait for its `kv` reply (or, to a fetch that reads blocks,
    `blocks`): up to the transfer timeout in all while the peer prefills, but no longer than
    the I/O timeout between its `wait` heartbeats (a frozen peer fails in `io_timeout_s`).
    Meanwhile the block hashes the answer must carry are computed (`check_identity` takes
    them)."""
    deadline = time.monotonic() + config.transfer_timeout_s
    try:
        send_msg(conn, fetch_msg(request, config.heartbeat_s))
        expected = prompt_hashes(own, peer.layout.block_size, request)
        reply = recv_msg(conn)
    except PeerClosedError as exc:  # before any answer: retried once on a fresh connection
        raise ClosedByPeer(str(exc)) from exc
    while reply["t"] == "wait":
        if time.monotonic() > deadline:
            raise TransferTimeoutError("the peer did not answer within the transfer timeout")
        reply = recv_msg(conn)
    return expect(reply, "kv", *(["blocks"] if request.reads_blocks else [])), expected


def prompt_hashes(own: Descriptor, block_size: int, request: FetchRequest) -> list[bytes]:
    """Our hashes (model digest and salt) of the prompt's blocks of `block_size` tokens, from
    `request.start_token` on."""
    hasher = BlockHasher(own.model.compat_digest(), block_size)
    return hasher.hashes(request.token_ids, request.cache_salt)[request.start_token // block_size :]


def check_identity(
    meta: ContainerMeta | Container, request: FetchRequest, expected: list[bytes]
) -> None:
    """The container holds the asked tokens from `request.start_token`, with the block hashes
    `prompt_hashes` gave (same model digest, salt and block size): else a `FormatError`."""
    start = request.start_token
    end = start + len(meta.token_ids)
    if tuple(meta.token_ids) != request.token_ids[start:end]:
        raise FormatError("the container holds other tokens than the prompt's")
    bs = meta.desc.layout.block_size
    if list(meta.block_hashes) != expected[: end // bs - start // bs]:
        raise FormatError("the container's block hashes are not the prompt's")
