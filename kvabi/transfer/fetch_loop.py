"""`serve_fetches`: the prefill side's answer loop, the same for every transport (TCP, NIXL).

After a transport's handshake, each `fetch` message is parsed and checked (fetch_checks.py),
the prefill runs through the provider, and the transport's `send` ships the stream. A failure
before the first layer is ready (bad request, prefill error) gets an `error` reply and the
connection stays usable; a failure while sending closes the stream, which abandons the prefill.
Until the first layer is ready (the prompt may wait behind others), a `wait` message goes out
as often as the fetch asks (a third of the asker's stall timeout, at most ours): the asker
tells a busy peer from a frozen one by it.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.fetch_checks import heartbeat_interval, parse_fetch
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.layer_feed import LayerBuffers
from kvabi.transfer.transport import (
    KVLoan,
    KVPayload,
    KVStream,
    StreamProvider,
    TransportConfig,
)
from kvabi.wire.container_writer import ContainerWriter, PreparedSection

log = logging.getLogger("kvabi.disagg")
# send(conn, stream, first layer, is_live): is_live is False for a payload computed in full
Send = Callable[[socket.socket, KVStream, LayerBuffers, bool], None]
# lend(conn, loan): the loan's blocks as a peer READs them; releases the loan
Lend = Callable[[socket.socket, KVLoan], None]


def serve_fetches(
    conn: socket.socket,
    config: TransportConfig,
    desc: Descriptor,
    provider: StreamProvider,
    send: Send,
    is_closed: Callable[[], bool],
    lend: Lend | None = None,
) -> None:
    """Answer fetches on an authenticated connection until the peer leaves or the server
    closes (errors end the connection: the caller logs them). A transport that can have its
    pool's blocks READ gives `lend`; without it a fetch never gets a loan."""
    while not is_closed():
        conn.settimeout(config.idle_timeout_s)
        msg = expect(recv_msg(conn), "fetch")
        conn.settimeout(config.io_timeout_s)
        _answer(conn, msg, config, desc, provider, (send, lend))


def _answer(
    conn: socket.socket,
    msg: dict,
    config: TransportConfig,
    desc: Descriptor,
    provider: StreamProvider,
    senders: tuple[Send, Lend | None],
) -> None:
    send, lend = senders
    try:
        request = parse_fetch(msg, config.max_tokens, desc.layout.block_size)
        if lend is None:
            request = replace(request, reads_blocks=False)
        with Heartbeat(conn, heartbeat_interval(msg, config)):
            answer = provider(request)
            if isinstance(answer, KVLoan) and lend is None:
                answer = answer.to_payload()
            if not isinstance(answer, KVLoan):
                stream = KVStream.of(answer) if isinstance(answer, KVPayload) else answer
                first = next(stream.layers)  # the prefill's failures up to here get an answer
    except Exception as exc:
        log.warning("prefill for a fetch failed: %s", exc)
        send_msg(conn, {"t": "error", "kind": "prefill", "msg": str(exc)[:2000]})
        return
    if isinstance(answer, KVLoan):
        assert lend is not None
        lend(conn, answer)  # after the heartbeat: one sender on `conn` at a time
        return
    try:
        send(conn, stream, first, not isinstance(answer, KVPayload))
    finally:
        stream.layers.close()  # abandons the prefill if sending failed


def sections(
    writer: ContainerWriter, stream: KVStream, first: LayerBuffers, is_live: bool
) -> Iterator[PreparedSection]:
    """The stream's sections for `writer.write_prepared`, in order: a live stream's as each
    layer is stored; a payload computed in full has all of them prepared first, so the send
    loop is only checksums and writes (see `ContainerWriter`)."""
    layers = itertools.chain([first], stream.layers)
    if is_live:
        return (writer.prepare(layer_id, tensors) for layer_id, tensors in layers)
    return iter([writer.prepare(layer_id, tensors) for layer_id, tensors in layers])


class Heartbeat:
    """While inside `with`, send a `wait` message every `interval_s` on `conn` (from a thread
    of its own; nothing else sends on `conn` meanwhile). A failed send ends the heartbeat: the
    reply that follows fails the same way."""

    def __init__(self, conn: socket.socket, interval_s: float) -> None:
        self.conn, self.interval_s = conn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvabi-kv-wait", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                send_msg(self.conn, {"t": "wait"})
            except Exception:
                return
