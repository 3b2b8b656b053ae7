"""The TCP transport's decode side: a small pool of handshaken connections to one prefill peer.

`fetch` sends the prompt, waits (up to the transfer timeout) for the `kv` message, then reads
the container with `iter_layers`: each layer's section is verified as it arrives, the end record
last; nothing is returned unless all of it passed and it is exactly the blocks asked for. The
announced length is checked against what the request can need before a buffer is taken; the
container is received straight into that (reused) buffer and the payload's tensors are views
of it (`ReceiveBuffers`). A connection that saw any error is closed, never reused.
"""

from __future__ import annotations

import socket
import threading
import time

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.errors import MessageTooLargeError, TransferError
from kvabi.transfer.fetch_checks import ClosedByPeer, ask_kv, check_identity
from kvabi.transfer.framing import SocketStream, recv_exact
from kvabi.transfer.handshake import client_handshake
from kvabi.transfer.receive_buffers import ReceiveBuffers
from kvabi.transfer.transport import (
    FetchRequest,
    KVClient,
    KVPayload,
    TransportConfig,
    split_address,
)
from kvabi.wire.container import ContainerMeta, LayerSection, iter_layers
from kvabi.wire.container_format import HEADER, Header, container_size
from kvabi.wire.errors import FormatError


class TcpKVClient(KVClient):
    def __init__(self, config: TransportConfig, address: str, desc: Descriptor) -> None:
        self.config, self.address, self.desc = config, address, desc
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._buffers = ReceiveBuffers()
        conn, self.peer_desc = self._open()  # the handshake happens now, not at a request
        self._idle.append(conn)

    def fetch(self, request: FetchRequest) -> KVPayload:
        conn, is_reused = self._take()
        try:
            payload = self._fetch_on(conn, request)
        except ClosedByPeer:
            conn.close()
            if not is_reused:
                raise
            conn = self._take_new()  # an idle connection the peer dropped: once more, fresh
            try:
                payload = self._fetch_on(conn, request)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.append(conn)
        return payload

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()

    def _open(self) -> tuple[socket.socket, Descriptor]:
        conn = socket.create_connection(split_address(self.address), self.config.io_timeout_s)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.config.io_timeout_s)
            return conn, client_handshake(conn, self.config.secret, self.desc)
        except BaseException:
            conn.close()
            raise

    def _take(self) -> tuple[socket.socket, bool]:
        """An idle connection (True) or a new one (False)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._take_new(), False

    def _take_new(self) -> socket.socket:
        try:
            return self._open()[0]
        except TransferError:
            raise  # typed already (e.g. a handshake the frozen peer never answers)
        except OSError as exc:
            raise TransferError(f"cannot reach prefill peer {self.address}: {exc}") from exc

    def _fetch_on(self, conn: socket.socket, request: FetchRequest) -> KVPayload:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        reply, expected = ask_kv(conn, request, self.config, self.desc, self.peer_desc)
        head = recv_exact(conn, HEADER.size)
        limit = self._checked_size(request, reply, Header.parse(memoryview(head)))
        stream = SocketStream(conn, head, limit)
        payload = self._read(stream, self._buffers.take(limit), request, expected)
        if time.monotonic() > deadline:
            raise TransferError("the fetch finished after its transfer timeout")
        return payload

    def _checked_size(self, request: FetchRequest, reply: dict, header: Header) -> int:
        start, size = reply.get("start_token"), reply.get("num_bytes")
        if start != request.start_token or not isinstance(size, int):
            raise TransferError(f"kv reply for start {start!r}, asked {request.start_token}")
        num_tokens = len(request.token_ids) - request.start_token
        if header.num_tokens > num_tokens:
            raise MessageTooLargeError(f"{header.num_tokens} tokens sent, {num_tokens} asked")
        hashes = header.num_tokens // self.peer_desc.layout.block_size
        cap = container_size(self.peer_desc, header.num_tokens, hashes)
        if size != cap:
            raise MessageTooLargeError(f"kv reply announces {size} bytes; it can be {cap}")
        return size

    def _read(
        self, stream: SocketStream, buffer: memoryview, request: FetchRequest, expected: list[bytes]
    ) -> KVPayload:
        meta, sections = None, []
        for item in iter_layers(stream, self.desc.model, buffer):  # type: ignore[arg-type]
            if isinstance(item, ContainerMeta):
                meta = item
                if meta.desc != self.peer_desc:
                    raise FormatError("the container's descriptor is not the negotiated one")
            elif isinstance(item, LayerSection):
                sections.append(item)  # its tensors are made after the loop (LayerSection)
        if meta is None or stream.left:
            raise FormatError("the container ended early or has trailing bytes")
        check_identity(meta, request, expected)
        tensors = {k: v for section in sections for k, v in section.tensors.items()}
        cache = CacheBuffers(meta.desc, tensors)

        hashes = tuple(meta.block_hashes)
        return KVPayload(request.start_token, tuple(meta.token_ids), hashes, cache)
