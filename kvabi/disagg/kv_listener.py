"""`KVListener`: the accept loop both KV servers (TCP, NIXL) run on their control port.

It binds the address and, once started, accepts connections on its own thread and serves each
on a thread of its own through `serve(conn)`, at most `MAX_CONNECTIONS` at once (more are
refused: one thread each, so a flood must not grow without bound). `close` stops accepting
and closes every open connection, which ends their threads' blocking reads.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from kvabi.disagg.transport import split_address

MAX_CONNECTIONS = 256


class KVListener:
    def __init__(self, address: str, serve: Callable[[socket.socket], None], name: str) -> None:
        self._serve = serve
        self._socket = socket.create_server(split_address(address), backlog=64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.is_closed = False
        self._name = name

    def start(self) -> KVListener:
        """Begin accepting (after the owner holds this object: `serve` may refer to it)."""
        threading.Thread(target=self._accept_loop, name=self._name, daemon=True).start()
        return self

    @property
    def address(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self.is_closed = True
        self._socket.close()
        with self._lock:
            for conn in list(self._conns):
                conn.close()

    def _accept_loop(self) -> None:
        while not self.is_closed:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
