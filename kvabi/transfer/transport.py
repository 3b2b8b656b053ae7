"""The transport seam: how a decode instance gets a prompt's KV from a prefill instance.

A `Transport` listens (prefill side, serving `KVProvider` answers) and connects (decode side,
a `KVClient` that fetches). Every implementation carries the same thing: the ABI container of
the requested blocks (descriptor, token ids and block hashes in its meta, then one checksummed
section per layer), after a connect-time handshake that authenticates the peers and refuses
incompatible descriptors (`handshake.py`). A transport that `streams_layers` sends each
section as soon as the prefill has stored its layer (`KVStream`). Implementations: `tcp`
(`tcp_transport.py`) and `nixl` (`nixl_transport.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from kvabi.abi.buffers import CacheBuffers, owner_layers
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.kv_cache import BlockReservation, FetchRequest, KVLoan, KVPayload
from kvabi.wire.container_format import extent_for
from kvabi.wire.container_writer import layer_tensors


@dataclass(frozen=True)
class KVStream:
    """Blocks of a prompt's KV as the prefill computes them (tokens as in `KVPayload`):
    `layers` yields each owner layer, ascending, as `(layer_id, buffers)` once the forward
    has stored it, the buffers `len(token_ids) / block_size` blocks in `desc`'s layout. It
    blocks until the layer is ready and raises if the prefill fails; close it to abandon."""

    start_token: int
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    desc: Descriptor
    layers: Generator[tuple[int, dict[str, torch.Tensor]], None, None]

    @classmethod
    def of(cls, payload: KVPayload) -> KVStream:
        """A payload computed in full, as a stream whose layers are all ready."""
        cache, num_tokens = payload.cache, len(payload.token_ids)
        extent = extent_for(cache.desc, num_tokens)
        layers = ((i, layer_tensors(cache, i, extent)) for i in owner_layers(cache.desc))
        return cls(payload.start_token, payload.token_ids, payload.block_hashes, cache.desc, layers)


KVProvider = Callable[[FetchRequest], KVPayload]  # runs the prefill, returns its blocks
# A transport with `streams_layers` takes this instead: layer l goes on the wire while the
# prefill computes layer l + 1. To a request that `reads_blocks` it may answer with a loan
# of its pool's blocks (a transport that cannot READ them sends a copy).
StreamProvider = Callable[[FetchRequest], KVPayload | KVStream | KVLoan]


@dataclass(frozen=True)
class Landed:
    """What `KVClient.fetch_into` brought: `num_blocks` verified blocks written into the
    reservation's first blocks, or, from a peer that could not lend its pool's blocks, a
    `payload` to place as any fetch's (then nothing was written)."""

    num_blocks: int
    payload: KVPayload | None = None


@dataclass(frozen=True)
class TransportConfig:
    """What both ends of every transport need."""

    secret: bytes  # shared by all instances of a deployment; never sent
    io_timeout_s: float = 10.0  # the longest a send or receive may stall (a frozen peer)
    transfer_timeout_s: float = 120.0  # the longest a whole fetch (prefill + transfer) may take
    idle_timeout_s: float = 600.0  # a connection with no request for this long is closed
    handshake_timeout_s: float = 5.0  # the whole connect-time handshake, however it trickles
    max_tokens: int = 1 << 20  # the most tokens a fetch may name

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("secret: at least 16 bytes (e.g. `openssl rand -hex 32`)")
        timeouts = (self.io_timeout_s, self.transfer_timeout_s, self.idle_timeout_s)
        if min(*timeouts, self.handshake_timeout_s) <= 0:
            raise ValueError("timeouts: must be > 0")

    @property
    def heartbeat_s(self) -> float:
        """How often a prefill side that is still computing says so (a third of the stall
        timeout: a peer that says nothing for `io_timeout_s` is frozen, not busy)."""
        return self.io_timeout_s / 3


class KVServer(ABC):
    """A listening prefill endpoint."""

    @property
    @abstractmethod
    def address(self) -> str:
        """`host:port` clients connect to."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting and drop open connections."""


class KVClient(ABC):
    """A decode instance's connection(s) to one prefill endpoint, handshaken on creation."""

    peer_desc: Descriptor

    @abstractmethod
    def fetch(self, request: FetchRequest) -> KVPayload:
        """Have the peer prefill the prompt and return its verified blocks; raises a
        `TransferError` (timeout, peer gone, refused) or a container error (checksum)."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection."""

    def can_read_blocks(self, desc: Descriptor) -> bool:
        """Whether `fetch_into` can READ the peer's pool blocks into a pool of `desc`."""
        return False

    def fetch_into(self, request: FetchRequest, reservation: BlockReservation) -> Landed:
        """Have the peer prefill the prompt and READ its blocks straight into the reserved
        ones, verified before this returns (on a checksum mismatch a `ChecksumError`; the
        blocks must then not be indexed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a peer's pool blocks")


class Transport(ABC):
    name: str
    streams_layers: bool = False  # listen() takes a StreamProvider

    @abstractmethod
    def listen(
        self,
        address: str,
        desc: Descriptor,
        provider: KVProvider,
        pool: CacheBuffers | None = None,
    ) -> KVServer:
        """Serve `provider`'s answers on `address` (`host:port`; port 0 picks a free one).
        `pool`: the block pool whose blocks the provider may lend (`KVLoan`), for a transport
        whose peers READ them; None: it never lends."""

    @abstractmethod
    def connect(self, address: str, desc: Descriptor) -> KVClient:
        """Connect and handshake now: raises `PeerIncompatibleError` or `AuthError` at once."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address: expected host:port, got {address!r}")
    return host or "127.0.0.1", int(port)
