"""`DisaggSettings`: an instance's part in a disaggregated deployment (`kvabi serve --role`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.transfer.nixl_transport import NixlTransport
from kvabi.transfer.peer_backoff import PeerBackoff
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import Transport, TransportConfig, split_address

ROLES = ("prefill", "decode")
TRANSPORTS: dict[str, type[Transport]] = {"tcp": TcpTransport, "nixl": NixlTransport}


@dataclass(frozen=True)
class DisaggSettings:
    role: str  # prefill: computes prompts' KV and serves it; decode: fetches it, then decodes
    secret: bytes  # shared by the deployment's instances (and never sent)
    kv_address: str = "127.0.0.1:8100"  # prefill: where the KV endpoint listens
    peers: tuple[str, ...] = ()  # decode: the prefill KV endpoints it may fetch from
    transport: str = "tcp"
    io_timeout_s: float = 10.0  # a peer silent this long (no data, no heartbeat) is frozen
    transfer_timeout_s: float = 120.0  # a whole fetch: queueing, prefill and transfer
    peer_max_failures: int = 3  # decode: failed fetches in a row before a peer is skipped
    peer_cooldown_s: float = 30.0  # decode: how long it is skipped (doubling while it fails)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "nixl" and not is_nixl_available():
            raise ValueError(
                "transport nixl: the nixl package is not installed (install it "
                "with `pip install 'kvabi[nixl]'`, after torch==2.13.0)"
            )
        for address in (self.kv_address, *self.peers):
            split_address(address)
        self.transport_config()  # validates the secret and timeouts
        PeerBackoff(self.peer_max_failures, self.peer_cooldown_s)  # validates those

    def transport_config(self) -> TransportConfig:
        """What the transport needs of these settings."""
        return TransportConfig(self.secret, self.io_timeout_s, self.transfer_timeout_s)

    @property
    def transport_type(self) -> type[Transport]:
        return TRANSPORTS[self.transport]

    def make_transport(self) -> Transport:
        """The named transport over these settings."""
        return self.transport_type(self.transport_config())
