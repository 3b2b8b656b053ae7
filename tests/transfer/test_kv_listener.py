"""Unauthenticated connections to a KV endpoint cannot lock out peers (real loopback sockets)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvabi.transfer.kv_listener import MAX_PENDING, MAX_PENDING_PER_ADDRESS, KVListener
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest
from tests.disagg.tiny_peers import config, engine, prefill_server

PROMPT = tuple(range(3, 24))


class Trickler:
    """`n` raw connections that each send one byte of a handshake every `every_s` seconds
    (a slowloris: each receive succeeds, so no per-receive timeout ever fires)."""

    def __init__(self, address: str, n: int, every_s: float = 0.3) -> None:
        host, port = address.split(":")
        self.socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]
        self.every_s, self.num_closed_by_server = every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _drip(self) -> None:
        open_socks = list(self.socks)
        while open_socks and not self._stop.wait(self.every_s):
            for s in list(open_socks):
                try:
                    s.sendall(b"\x01")
                except OSError:
                    open_socks.remove(s)
                    self.num_closed_by_server += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


@pytest.fixture
def server():
    s = prefill_server(engine(), config(handshake_timeout_s=1.0))
    yield s
    s.close()


def test_a_peer_connects_and_fetches_while_300_clients_trickle_handshakes(server):
    attack = Trickler(server.address, 300)
    try:
        time.sleep(0.5)
        start = time.monotonic()
        client = TcpTransport(config()).connect(server.address, engine().info.descriptor)
        assert time.monotonic() - start < 2.0  # before: PeerClosedError after 0 of 4 bytes
        assert client.fetch(FetchRequest(PROMPT)).end_token == 20
        listener = server._listener
        assert listener.num_pending <= MAX_PENDING and listener.num_peers == 1
        client.close()
    finally:
        attack.close()


def test_the_whole_handshake_has_one_deadline_however_slowly_it_trickles(server):
    attack = Trickler(server.address, 3, every_s=0.2)
    try:
        time.sleep(2.0)  # the 1 s deadline passed; each trickled byte was received in time
        assert attack.num_closed_by_server == 3
        assert server._listener.num_pending == 0
    finally:
        attack.close()


def test_pending_connections_from_one_address_are_capped(server):
    attack = Trickler(server.address, 3 * MAX_PENDING_PER_ADDRESS, every_s=10)
    try:
        time.sleep(0.5)
        assert server._listener.num_pending == MAX_PENDING_PER_ADDRESS
    finally:
        attack.close()


def test_both_ends_of_a_control_connection_send_small_messages_at_once():
    """Nagle off on both ends: a `window` message right after `kv` must not wait 40 ms for the
    peer's delayed ACK (it made NIXL fetches 10x slower)."""
    e = engine()
    on_server: list[int] = []
    serve = lambda conn: on_server.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))  # noqa: E731
    listener = KVListener("127.0.0.1:0", config(), e.info.descriptor, serve, "test-accept")
    listener.start()
    try:
        client = TcpTransport(config()).connect(listener.address, e.info.descriptor)
        conn = client._take()[0]
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        client.close()
        deadline = time.monotonic() + 5
        while not on_server and time.monotonic() < deadline:
            time.sleep(0.01)
        assert on_server and on_server[0] != 0
    finally:
        listener.close()
