"""The TCP transport's prefill side: one thread per authenticated connection.

A connection handshakes (handshake.py, run by `KVListener`), then serves `fetch` messages one
at a time: the provider prefills the prompt and returns its blocks, in full (`KVPayload`) or
layer by layer as the forward stores them (`KVStream`). Once the first layer is ready a `kv`
message (the container's byte length) goes back, then the container, each layer's section as
soon as that layer is ready, in bounded chunks: layer l is on the wire while the prefill
computes l + 1. A failure before the first layer is answered with an `error` message and the
connection stays usable; a failure after it closes the connection (the peer sees a truncated
container).
"""

from __future__ import annotations

import logging
import socket

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.fetch_loop import sections, serve_fetches
from kvabi.transfer.framing import ChunkedSink, send_msg
from kvabi.transfer.kv_listener import KVListener
from kvabi.transfer.layer_feed import LayerBuffers
from kvabi.transfer.transport import (
    KVServer,
    KVStream,
    StreamProvider,
    TransportConfig,
)
from kvabi.wire.container_format import container_size
from kvabi.wire.container_writer import ContainerWriter

log = logging.getLogger("kvabi.disagg")


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
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # we gather small writes
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
