"""Control messages on a socket: `u32le length || msgpack map`, length capped before allocating.

Block payloads do not travel as control messages: they follow a `kv` message as one ABI
container (docs/ABI.md, section 5), written in bounded chunks (`ChunkedSink`).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import TypeVar

import msgpack

from kvabi.transfer.errors import (
    MessageTooLargeError,
    PeerClosedError,
    RemoteError,
    TransferError,
    TransferTimeoutError,
)

T = TypeVar("T")

LENGTH = struct.Struct("<I")
MAX_CONTROL_BYTES = 8 * 2**20  # a control message: token ids (4-5 B each) and a descriptor
CHUNK_BYTES = 4 * 2**20  # the most one send or receive call moves
SMALL_WRITE_BYTES = 64 * 2**10  # writes gathered into one send up to this size


def no_delay(conn: socket.socket) -> socket.socket:
    """`conn` with Nagle's algorithm off. Every control connection needs it: a small message
    sent right after another (`kv` then `window`) would otherwise wait for the peer's
    delayed ACK, 40 ms on Linux (measured: a NIXL fetch of 23.6 MB took 60-90 ms, its READs
    3.7 ms)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def open_control(address: tuple[str, int], timeout_s: float) -> socket.socket:
    """A control connection to `address`: connected, no delay, `timeout_s` on every call."""
    conn = socket.create_connection(address, timeout_s)
    try:
        conn.settimeout(timeout_s)
        return no_delay(conn)
    except BaseException:
        conn.close()
        raise


def send_msg(sock: socket.socket, msg: dict) -> None:
    """Send one control message."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_CONTROL_BYTES:
        raise MessageTooLargeError(f"control message of {len(body)} bytes > {MAX_CONTROL_BYTES}")
    _send_all(sock, LENGTH.pack(len(body)) + body)


def recv_msg(sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES) -> dict:
    """Receive one control message; its length is checked before any buffer is made."""
    (size,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    if size > max_bytes:
        raise MessageTooLargeError(f"peer announced a {size}-byte message; the cap is {max_bytes}")
    msg = msgpack.unpackb(recv_exact(sock, size), raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise TransferError("malformed control message (not a map with a type)")
    return msg


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes (n is already capped by the caller)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = _io(lambda v=view[got:]: sock.recv_into(v, min(len(v), CHUNK_BYTES)))
        if k == 0:
            raise PeerClosedError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def expect(msg: dict, kind: str, *others: str) -> dict:
    """`msg` if its type is `kind` (or one of `others`); a peer's error message becomes a
    typed error."""
    if msg["t"] == "error":
        raise RemoteError(f"peer error ({msg.get('kind', '?')}): {msg.get('msg', '')}")
    if msg["t"] != kind and msg["t"] not in others:
        raise TransferError(f"expected a {kind!r} message, got {msg['t']!r}")
    return msg


class ChunkedSink:
    """A write-only binary sink over a socket: small writes (headers, padding) are gathered
    and go out with the next large one; large ones go out in chunks of at most CHUNK_BYTES,
    each under the socket's timeout, the whole under `deadline_s`. Call `flush()` at the end."""

    def __init__(self, sock: socket.socket, deadline_s: float) -> None:
        self.sock, self.deadline = sock, time.monotonic() + deadline_s
        self.num_bytes = 0
        self._pending = bytearray()

    def write(self, data: bytes | memoryview) -> int:
        """Send (or gather) `data`; returns its length."""
        view = memoryview(data).cast("B")
        self.num_bytes += len(view)
        if len(self._pending) + len(view) <= SMALL_WRITE_BYTES:
            self._pending += view
            return len(view)
        self.flush()
        for start in range(0, len(view), CHUNK_BYTES):
            self._send(view[start : start + CHUNK_BYTES])
        return len(view)

    def flush(self) -> None:
        """Send what small writes gathered."""
        if self._pending:
            self._send(memoryview(self._pending))
            self._pending = bytearray()

    def _send(self, view: memoryview) -> None:
        if time.monotonic() > self.deadline:
            raise TransferTimeoutError("transfer deadline passed while sending")
        _send_all(self.sock, view)


class SocketStream:
    """A read-only binary stream over a socket for `iter_layers`: each read takes what has
    arrived, at most CHUNK_BYTES, and at most `limit` bytes in all (the container's size,
    known from its header). A peer that closes before the end is a `PeerClosedError`."""

    def __init__(self, sock: socket.socket, head: bytes, limit: int) -> None:
        self.sock, self.head, self.left = sock, head, limit - len(head)

    def readinto(self, buf: memoryview | bytearray) -> int:
        """Fill `buf` from the stream (at most its length, never past the limit); 0 at the end."""
        view = memoryview(buf).cast("B")
        if self.head:
            n = min(len(view), len(self.head))
            view[:n], self.head = self.head[:n], self.head[n:]
            return n
        n = min(len(view), self.left, CHUNK_BYTES)
        if n <= 0:
            return 0
        got = _io(lambda: self.sock.recv_into(view, n))
        if got == 0:
            raise PeerClosedError(f"peer closed the connection {self.left} bytes before its end")
        self.left -= got
        return got


def _send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    _io(lambda: sock.sendall(data))


def _io(fn: Callable[[], T]) -> T:
    """A socket call; timeouts and OS errors become transfer errors."""
    try:
        return fn()
    except TimeoutError as exc:
        raise TransferTimeoutError(f"peer stalled past the socket timeout: {exc}") from exc
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerClosedError(f"peer closed the connection: {exc}") from exc
    except OSError as exc:
        raise TransferError(f"connection failed: {exc}") from exc
