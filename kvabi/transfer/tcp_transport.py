"""`TcpTransport`: plain TCP (loopback by default), for where NIXL is not installed."""

from __future__ import annotations

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.tcp_client import TcpKVClient
from kvabi.transfer.tcp_server import TcpKVServer
from kvabi.transfer.transport import KVClient, KVServer, StreamProvider, Transport, TransportConfig


class TcpTransport(Transport):
    name = "tcp"
    streams_layers = True

    def __init__(self, config: TransportConfig) -> None:
        self.config = config

    def listen(self, address: str, desc: Descriptor, provider: StreamProvider) -> KVServer:
        """Serve on `address` (default deployments bind 127.0.0.1); `provider` may answer
        with a `KVStream`, sent layer by layer."""
        return TcpKVServer(self.config, address, desc, provider)

    def connect(self, address: str, desc: Descriptor) -> KVClient:
        """Connect and handshake now."""
        return TcpKVClient(self.config, address, desc)
