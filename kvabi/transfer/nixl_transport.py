"""`NixlTransport`: KV over NIXL (UCX: shared memory or TCP here, RDMA and GPU memory on a
cluster), with the TCP transport's authenticated control connection.

Design: the control plane is the TCP transport's (handshake.py, framing.py): shared-secret
challenge-response and descriptor negotiation before anything else, capped messages, and the
NIXL agent metadata only after authentication. The data plane is a pull: the prefill side
stages the ABI container in slots of a preallocated, once-registered arena and publishes each
slot; the decode side READs it into its own registered slot (nixl_windows.py). READ, not
WRITE, because the side that needs the bytes drives the pace and the deadline (a stalled peer
is a timeout where it matters), the decode side never exposes its memory, and it is how
vLLM's NixlConnector moves KV. Integrity is the container's own section checksums.
"""

from __future__ import annotations

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.nixl_client import NixlKVClient
from kvabi.transfer.nixl_memory import load_nixl
from kvabi.transfer.nixl_server import NixlKVServer
from kvabi.transfer.transport import KVClient, KVServer, StreamProvider, Transport, TransportConfig

SLOT_BYTES = 16 * 2**20  # one window: one READ, one NIXL descriptor
NUM_SLOTS = 8  # prefill arena: 4 transfers at once, 2 windows in flight each
DEPTH = 2  # windows a transfer stages ahead of the decode side's READs


class NixlTransport(Transport):
    name = "nixl"
    streams_layers = True

    def __init__(
        self, config: TransportConfig, slot_bytes: int = SLOT_BYTES, num_slots: int = NUM_SLOTS
    ) -> None:
        load_nixl()  # a clear NixlUnavailableError now, not at the first transfer
        self.config, self.slot_bytes, self.num_slots = config, slot_bytes, num_slots

    def listen(
        self,
        address: str,
        desc: Descriptor,
        provider: StreamProvider,
        pool: CacheBuffers | None = None,
    ) -> KVServer:
        """Serve on `address` (default deployments bind 127.0.0.1); `provider` may answer
        with a `KVStream`, published layer by layer, or lend blocks of `pool` (registered
        now, so that the agent metadata peers load names it)."""
        shape = (self.slot_bytes, self.num_slots)
        return NixlKVServer(self.config, address, desc, provider, shape, DEPTH, pool)

    def connect(self, address: str, desc: Descriptor) -> KVClient:
        """Connect, handshake and learn the peer's NIXL agent now."""
        return NixlKVClient(self.config, address, desc)
