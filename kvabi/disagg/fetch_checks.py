"""The checks every transport makes of a fetch: the request on the prefill side, the answer's
identity on the decode side (both the TCP and the NIXL transport use them).
"""

from __future__ import annotations

import socket

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.descriptor import Descriptor
from kvabi.disagg.errors import MessageTooLargeError, PeerClosedError, TransferError
from kvabi.disagg.framing import expect, recv_msg, send_msg
from kvabi.disagg.transport import FetchRequest, TransportConfig
from kvabi.wire.container import Container, ContainerMeta
from kvabi.wire.errors import FormatError


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
    if salt is not None and not isinstance(salt, str):
        raise TransferError("fetch: cache_salt must be a string")
    return FetchRequest(tuple(ids), start, salt)


def fetch_msg(request: FetchRequest) -> dict:
    """The `fetch` control message of `request`."""
    return {
        "t": "fetch",
        "token_ids": list(request.token_ids),
        "start_token": request.start_token,
        "cache_salt": request.cache_salt,
    }


class ClosedByPeer(PeerClosedError):
    """The peer closed the connection before answering (e.g. an idle connection it dropped):
    the fetch may be retried on a new connection."""


def ask_kv(conn: socket.socket, request: FetchRequest, config: TransportConfig) -> dict:
    """Send the `fetch` message and wait (up to the transfer timeout: the peer prefills
    first) for its `kv` reply; the connection is left at the I/O timeout."""
    try:
        send_msg(conn, fetch_msg(request))
        conn.settimeout(config.transfer_timeout_s)
        reply = expect(recv_msg(conn), "kv")
    except PeerClosedError as exc:
        raise ClosedByPeer(str(exc)) from exc
    conn.settimeout(config.io_timeout_s)
    return reply


def check_identity(own: Descriptor, meta: ContainerMeta | Container, request: FetchRequest) -> None:
    """The container holds the asked tokens from `request.start_token`, hashed by the same
    scheme (model digest and salt) as ours: else a `FormatError`."""
    start = request.start_token
    end = start + len(meta.token_ids)
    if tuple(meta.token_ids) != request.token_ids[start:end]:
        raise FormatError("the container holds other tokens than the prompt's")
    salt = None if request.cache_salt is None else {"cache_salt": request.cache_salt}
    root = root_hash(own.model.compat_digest(), salt)
    bs = meta.desc.layout.block_size
    expected = hash_blocks(request.token_ids[:end], bs, root)[start // bs :]
    if list(meta.block_hashes) != expected:
        raise FormatError("the container's block hashes are not the prompt's")
