"""The transport seam: how a decode instance gets a prompt's KV from a prefill instance.

A `Transport` listens (prefill side, serving `KVProvider` answers) and connects (decode side,
a `KVClient` that fetches). Every implementation carries the same thing: the ABI container of
the requested blocks (descriptor, token ids and block hashes in its meta, then one checksummed
section per layer), after a connect-time handshake that authenticates the peers and refuses
incompatible descriptors (`handshake.py`). Implementations: `tcp` (`tcp_server.py`,
`tcp_client.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor


@dataclass(frozen=True)
class FetchRequest:
    """KV wanted for `token_ids` (a whole prompt) from token `start_token` on; the blocks
    before it the asker already holds. `start_token` is a multiple of both block sizes."""

    token_ids: tuple[int, ...]
    start_token: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class KVPayload:
    """Blocks of a prompt's KV: tokens `start_token .. start_token + len(token_ids) - 1` in
    the sender's layout (`cache.extent` blocks), with the sender's block hashes of them."""

    start_token: int
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    cache: CacheBuffers

    @property
    def end_token(self) -> int:
        """One past the last token whose KV the payload holds."""
        return self.start_token + len(self.token_ids)


KVProvider = Callable[[FetchRequest], KVPayload]  # runs the prefill, returns its blocks


@dataclass(frozen=True)
class TransportConfig:
    """What both ends of every transport need."""

    secret: bytes  # shared by all instances of a deployment; never sent
    io_timeout_s: float = 10.0  # the longest a send or receive may stall
    transfer_timeout_s: float = 120.0  # the longest a whole fetch (prefill + transfer) may take
    idle_timeout_s: float = 600.0  # a connection with no request for this long is closed
    max_tokens: int = 1 << 20  # the most tokens a fetch may name

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("secret: at least 16 bytes (e.g. `openssl rand -hex 32`)")
        if min(self.io_timeout_s, self.transfer_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeouts: must be > 0")


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


class Transport(ABC):
    name: str

    @abstractmethod
    def listen(self, address: str, desc: Descriptor, provider: KVProvider) -> KVServer:
        """Serve `provider`'s answers on `address` (`host:port`; port 0 picks a free one)."""

    @abstractmethod
    def connect(self, address: str, desc: Descriptor) -> KVClient:
        """Connect and handshake now: raises `PeerIncompatibleError` or `AuthError` at once."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address: expected host:port, got {address!r}")
    return host or "127.0.0.1", int(port)
