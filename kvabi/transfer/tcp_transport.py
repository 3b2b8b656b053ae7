"""`TcpTransport`: plain TCP (loopback by default), for where NIXL is not installed.

Prefill side (`TcpKVServer`): one thread per authenticated connection. A connection handshakes
(handshake.py, run by `KVListener`), then serves `fetch` messages one at a time: the provider
prefills the prompt and returns its blocks, in full (`KVPayload`) or layer by layer as the
forward stores them (`KVStream`). Once the first layer is ready a `kv` message (the container's
byte length) goes back, then the container, each layer's section as soon as that layer is
ready, in bounded chunks: layer l is on the wire while the prefill computes l + 1. A failure
before the first layer is answered with an `error` message and the connection stays usable; a
failure after it closes the connection (the peer sees a truncated container).

Decode side (`TcpKVClient`): a small pool of handshaken connections to one prefill peer.
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
from kvabi.transfer.fetch_loop import sections, serve_fetches
from kvabi.transfer.framing import (
    ChunkedSink,
    SocketStream,
    open_control,
    recv_exact,
    send_msg,
)
from kvabi.transfer.handshake import client_handshake
from kvabi.transfer.kv_listener import KVListener
from kvabi.transfer.layer_feed import LayerBuffers
from kvabi.transfer.receive_buffers import ReceiveBuffers
from kvabi.transfer.transport import (
    FetchRequest,
    KVClient,
    KVPayload,
    KVServer,
    KVStream,
    StreamProvider,
    Transport,
    TransportConfig,
    split_address,
)
from kvabi.wire.container import ContainerMeta, LayerSection, iter_layers
from kvabi.wire.container_format import HEADER, Header, container_size
from kvabi.wire.container_writer import ContainerWriter
from kvabi.wire.errors import FormatError


class TcpTransport(Transport):
    name = "tcp"
    streams_layers = True

    def __init__(self, config: TransportConfig) -> None:
        self.config = config

    def listen(
        self,
        address: str,
        desc: Descriptor,
        provider: StreamProvider,
        pool: CacheBuffers | None = None,
    ) -> KVServer:
        """Serve on `address` (default deployments bind 127.0.0.1); `provider` may answer
        with a `KVStream`, sent layer by layer. No peer READs `pool`: a loan goes as a copy."""
        return TcpKVServer(self.config, address, desc, provider)

    def connect(self, address: str, desc: Descriptor) -> KVClient:
        """Connect and handshake now."""
        return TcpKVClient(self.config, address, desc)


class TcpKVServer(KVServer):
    def __init__(
        self, config: TransportConfig, address: str, desc: Descriptor, provider: StreamProvider
    ) -> None:
        self.config, self.desc, self.provider = config, desc, provider
        self._listener = KVListener(address, config, desc, self._serve, "kvabi-kv-accept")
        self._listener.start()

    @property
    def address(self) -> str:
        return self._listener.address

    def close(self) -> None:
        self._listener.close()

    def _serve(self, conn: socket.socket) -> None:
        """An authenticated connection (KVListener did the handshake); errors end it."""
        send, is_closed = self._send_stream, self._is_closed
        serve_fetches(conn, self.config, self.desc, self.provider, send, is_closed)

    def _is_closed(self) -> bool:
        return self._listener.is_closed

    def _send_stream(
        self, conn: socket.socket, stream: KVStream, first: LayerBuffers, is_live: bool
    ) -> None:
        """The `kv` message, then the container: each section as its layer arrives (live or
        not, TCP sends the same way)."""
        size = container_size(stream.desc, len(stream.token_ids), len(stream.block_hashes))
        send_msg(conn, {"t": "kv", "start_token": stream.start_token, "num_bytes": size})
        sink = self._sink(conn, stream)
        writer = ContainerWriter(sink, stream.desc, stream.token_ids, stream.block_hashes)
        sink.flush()  # the meta goes now: the peer checks it while the layers are prepared
        for section in sections(writer, stream, first, is_live):
            writer.write_prepared(section)
            sink.flush()  # a layer's tail goes now, not with the next layer
        writer.close()
        sink.flush()

    def _sink(self, conn: socket.socket, stream: KVStream) -> ChunkedSink:
        """Where a stream's container bytes go (a seam: tests/transfer/faults.py wraps it)."""
        return ChunkedSink(conn, self.config.transfer_timeout_s)


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
        conn = open_control(split_address(self.address), self.config.io_timeout_s)
        try:
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
