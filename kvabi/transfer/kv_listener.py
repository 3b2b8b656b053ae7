"""`KVListener`: the accept loop both KV servers (TCP, NIXL) run on their control port.

It binds the address and, once started, accepts connections on its own thread. Each connection
is served on a thread of its own: first the handshake (handshake.py), then, once the peer is
authenticated, the server's `serve(conn)`. Unauthenticated connections cannot starve peers:

- the whole handshake has one deadline (`TransportConfig.handshake_timeout_s`), however slowly
  the client trickles bytes: the accept loop closes a pending connection past it;
- pending (unauthenticated) connections are capped per client address
  (`MAX_PENDING_PER_ADDRESS`) and in all (`MAX_PENDING`); a new connection over a cap replaces
  the oldest pending one, so a flood delays a real peer by at most its own handshake;
- authenticated connections have their own cap (`MAX_PEERS`), which pending ones never use.

`close` stops accepting and closes every open connection, which ends their threads' reads.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.framing import no_delay
from kvabi.transfer.handshake import server_handshake
from kvabi.transfer.transport import TransportConfig, split_address

log = logging.getLogger("kvabi.disagg")
MAX_PEERS = 256
MAX_PENDING = 64
MAX_PENDING_PER_ADDRESS = 8
REAP_INTERVAL_S = 0.2


@dataclass
class _Pending:
    host: str
    deadline: float


class KVListener:
    def __init__(
        self,
        address: str,
        config: TransportConfig,
        desc: Descriptor,
        serve: Callable[[socket.socket], None],
        name: str,
    ) -> None:
        self.config, self.desc, self._serve, self._name = config, desc, serve, name
        self._socket = socket.create_server(split_address(address), backlog=64)
        self._socket.settimeout(REAP_INTERVAL_S)  # the accept loop also reaps pending ones
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        self._peers: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.is_closed = False

    def start(self) -> KVListener:
        """Begin accepting (after the owner holds this object: `serve` may refer to it)."""
        threading.Thread(target=self._accept_loop, name=self._name, daemon=True).start()
        return self

    @property
    def address(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        self.is_closed = True
        self._socket.close()
        with self._lock:
            for conn in [*self._pending, *self._peers]:
                conn.close()

    def _accept_loop(self) -> None:
        while not self.is_closed:
            self._reap()
            try:
                conn, addr = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._admit(no_delay(conn), addr[0])
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket, host: str) -> None:
        """Register a new pending connection, making room under the caps first."""
        with self._lock:
            same = [c for c, p in self._pending.items() if p.host == host]
            if len(same) >= MAX_PENDING_PER_ADDRESS:
                self._drop(same[0])
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending)))
            deadline = time.monotonic() + self.config.handshake_timeout_s
            self._pending[conn] = _Pending(host, deadline)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conn in [c for c, p in self._pending.items() if p.deadline < now]:
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        """Close a pending connection (its thread's read fails and it ends); lock held."""
        self._pending.pop(conn, None)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv at once
        conn.close()

    def _run(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(min(self.config.io_timeout_s, self.config.handshake_timeout_s))
            server_handshake(conn, self.config.secret, self.desc)
            if self._authenticated(conn):
                conn.settimeout(self.config.io_timeout_s)
                self._serve(conn)
        except Exception as exc:  # the connection ends; the server goes on
            log.info("kv connection closed: %s", exc)
        finally:
            with self._lock:
                self._pending.pop(conn, None)
                self._peers.discard(conn)
            conn.close()

    def _authenticated(self, conn: socket.socket) -> bool:
        """Move the connection from pending to peers; False if it was reaped or peers are full."""
        with self._lock:
            if self._pending.pop(conn, None) is None or len(self._peers) >= MAX_PEERS:
                return False
            self._peers.add(conn)
            return True
