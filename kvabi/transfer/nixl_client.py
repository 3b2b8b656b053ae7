"""The `nixl` transport's decode side: handshaken control connections to one prefill peer and
one registered arena whose slots the fetches READ into.

A connection handshakes as on TCP, then asks for the peer's NIXL metadata (`nixl_hello`),
which is added to our agent once per peer agent. `fetch` sends the prompt, waits (up to the
transfer timeout) for the `kv` message, whose announced size is checked against what the
request can need, then reads the container window by window (nixl_windows.py) into one
buffer, which `read_container` verifies in place (every section checksum); nothing is
returned unless all of it passed and it is exactly the blocks asked for. A connection that saw
any error is closed.
"""

from __future__ import annotations

import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from kvabi.abi.descriptor import Descriptor
from kvabi.cache.kv_cache import BlockReservation
from kvabi.transfer.errors import MessageTooLargeError, TransferError
from kvabi.transfer.fetch_checks import ClosedByPeer, ask_kv, check_identity
from kvabi.transfer.framing import expect, open_control, recv_msg, send_msg
from kvabi.transfer.handshake import client_handshake
from kvabi.transfer.lent_blocks import Landing, converting_landing, read_lent
from kvabi.transfer.nixl_memory import Arena, ArenaInfo, PoolRegistry, StagingBuffers, make_agent
from kvabi.transfer.nixl_read import NixlReadAbandoned
from kvabi.transfer.nixl_windows import WindowReader
from kvabi.transfer.receive_buffers import ReceiveBuffers
from kvabi.transfer.transport import (
    FetchRequest,
    KVClient,
    KVPayload,
    Landed,
    TransportConfig,
    split_address,
)
from kvabi.wire.container import read_container
from kvabi.wire.container_format import container_size
from kvabi.wire.errors import FormatError

MAX_METADATA_BYTES = 2**20
MAX_SLOT_BYTES = 256 * 2**20  # the most a peer's window may make us register per slot


_Into = tuple[int, "BlockReservation | None"]  # (arena slot, reservation to READ blocks into)


@dataclass(frozen=True)
class _Channel:
    conn: socket.socket
    peer: ArenaInfo


class NixlKVClient(KVClient):
    def __init__(
        self, config: TransportConfig, address: str, desc: Descriptor, num_slots: int = 4
    ) -> None:
        self.config, self.address, self.desc, self.num_slots = config, address, desc, num_slots
        self.agent = make_agent("decode")
        self.arena: Arena | None = None  # sized by the first peer's windows
        self._peer_agents: set[str] = set()
        self._idle: list[_Channel] = []
        self._lock = threading.Lock()
        self._buffers = ReceiveBuffers()  # containers land in reused buffers (no page faults)
        self._pools = PoolRegistry(self.agent)  # the pools lent blocks land in
        self._worker = ThreadPoolExecutor(1, "kvabi-nixl-land")  # checksums beside READs
        channel, self.peer_desc = self._open()  # the handshake happens now, not at a request
        self._idle.append(channel)
        self._staging = StagingBuffers(self._pools, self.peer_desc)  # for other layouts

    def fetch(self, request: FetchRequest) -> KVPayload:
        landed = self._fetch(replace(request, reads_blocks=False), None)
        assert landed.payload is not None
        return landed.payload

    def can_read_blocks(self, desc: Descriptor) -> bool:
        """Into a pool of the peer's descriptor straight; of another paged layout of the same
        shard, through staging buffers and a conversion per part."""
        own, peer = desc.layout, self.peer_desc.layout
        same_shard = (own.tp_size, own.tp_rank) == (peer.tp_size, peer.tp_rank)
        return desc == self.peer_desc or (own.is_paged and peer.is_paged and same_shard)

    def fetch_into(self, request: FetchRequest, reservation: BlockReservation) -> Landed:
        if not self.can_read_blocks(reservation.buffers.desc):
            raise TransferError("the peer's blocks cannot be read into this pool: fetch them")
        if request.start_token != reservation.start_token:
            raise ValueError("fetch_into: the request and the reservation start elsewhere")
        own_bs = reservation.buffers.desc.layout.block_size
        step = math.lcm(own_bs, self.peer_desc.layout.block_size)  # whole blocks of both sizes
        end = request.start_token + len(reservation.block_ids) * own_bs // step * step
        if end <= request.start_token:
            return Landed(0)
        asked = request.token_ids[:end]  # the peer prefills and lends no more than fits
        return self._fetch(replace(request, token_ids=asked, reads_blocks=True), reservation)

    def _fetch(self, request: FetchRequest, reservation: BlockReservation | None) -> Landed:
        assert self.arena is not None
        slots = self.arena.acquire(1, self.config.io_timeout_s)
        try:
            channel, is_reused = self._take()
            landed = self._fetch_retrying(channel, is_reused, request, (slots[0], reservation))
        except NixlReadAbandoned:
            slots = []  # a READ may still land in it: never lend it again
            raise
        finally:
            self.arena.release(slots)
        return landed

    def close(self) -> None:
        with self._lock:
            for channel in self._idle:
                channel.conn.close()
            self._idle.clear()
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            self._pools.close()
        self._worker.shutdown()

    def _fetch_retrying(
        self, channel: _Channel, is_reused: bool, request: FetchRequest, into: _Into
    ) -> Landed:
        try:
            landed = self._fetch_on(channel, request, into)
        except ClosedByPeer:
            channel.conn.close()
            if not is_reused:
                raise
            channel = self._take_new()  # an idle connection the peer dropped: once more, fresh
            try:
                landed = self._fetch_on(channel, request, into)
            except BaseException:
                channel.conn.close()
                raise
        except BaseException:
            channel.conn.close()
            raise
        with self._lock:
            self._idle.append(channel)
        return landed

    def _open(self) -> tuple[_Channel, Descriptor]:
        conn = open_control(split_address(self.address), self.config.io_timeout_s)
        try:
            peer_desc = client_handshake(conn, self.config.secret, self.desc)
            send_msg(conn, {"t": "nixl_hello"})
            return _Channel(conn, self._add_peer(recv_msg(conn, MAX_METADATA_BYTES))), peer_desc
        except BaseException:
            conn.close()
            raise

    def _add_peer(self, msg: dict) -> ArenaInfo:
        """Learn the peer's agent (once) and check its windows fit our slots."""
        msg = expect(msg, "nixl_md")
        info, md = ArenaInfo.from_msg(msg), msg.get("md")
        if not isinstance(md, bytes) or not 0 < info.slot_bytes <= MAX_SLOT_BYTES:
            raise TransferError(f"peer's nixl arena refused: slots of {info.slot_bytes} bytes")
        with self._lock:
            if info.agent_name not in self._peer_agents:
                name = self.agent.add_remote_agent(md)  # bytes in nixl 1.5
                if isinstance(name, bytes):
                    name = name.decode(errors="replace")
                if name != info.agent_name:
                    raise TransferError(f"nixl metadata names agent {name!r}, not the peer's")
                self._peer_agents.add(info.agent_name)
            if self.arena is None:
                self.arena = Arena(self.agent, info.slot_bytes, self.num_slots)
            elif info.slot_bytes > self.arena.slot_bytes:
                raise TransferError("the peer's windows outgrew our slots (it restarted?)")
        return info

    def _take(self) -> tuple[_Channel, bool]:
        """An idle connection (True) or a new one (False)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._take_new(), False

    def _take_new(self) -> _Channel:
        try:
            return self._open()[0]
        except TransferError:
            raise  # typed already (e.g. a handshake the frozen peer never answers)
        except OSError as exc:
            raise TransferError(f"cannot reach prefill peer {self.address}: {exc}") from exc

    def _fetch_on(self, channel: _Channel, request: FetchRequest, into: _Into) -> Landed:
        """One fetch: a container read through `into`'s arena slot, or, to a fetch that reads
        blocks, the lent blocks READ into `into`'s reservation."""
        conn, (slot, reservation) = channel.conn, into
        reply, expected = ask_kv(conn, request, self.config, self.desc, self.peer_desc)
        timeouts = (self.config.io_timeout_s, self.config.transfer_timeout_s)
        if reply["t"] == "blocks":
            assert reservation is not None
            return self._read_lent(channel, reply, request, expected, reservation)
        size = self._checked_size(request, reply)
        assert self.arena is not None
        data = np.frombuffer(self._buffers.take(size), dtype=np.uint8)  # [size], not yet written
        WindowReader(conn, self.arena, slot, channel.peer, timeouts).read_all(data)
        return Landed(0, self._payload(memoryview(data), request, expected))

    def _read_lent(
        self,
        channel: _Channel,
        reply: dict,
        request: FetchRequest,
        expected: list[bytes],
        reservation: BlockReservation,
    ) -> Landed:
        """The lent blocks READ into the reservation, straight or through staging buffers."""
        peer_bs = self.peer_desc.layout.block_size
        num_peer_blocks = (len(request.token_ids) - request.start_token) // peer_bs
        staging = None
        if reservation.buffers.desc == self.peer_desc:
            landing = Landing(
                reservation.buffers,
                self._pools.regions(reservation.buffers),
                reservation.block_ids,
            )  # fmt: skip
        else:
            staging = self._staging.take(num_peer_blocks)
            landing = converting_landing(staging, self._pools.regions(staging), reservation)
        timeout_s = min(self.config.io_timeout_s, self.config.transfer_timeout_s)
        args = (reply, request, expected, landing, timeout_s, self._worker)
        try:
            num_blocks = read_lent(channel.conn, self.agent, channel.peer.agent_name, *args)
        except NixlReadAbandoned:
            staging = None  # a READ may still land in it: never lend it again
            raise
        finally:
            if staging is not None:
                self._staging.give_back(staging)
        own_bs = reservation.buffers.desc.layout.block_size
        return Landed(num_blocks * peer_bs // own_bs)

    def _checked_size(self, request: FetchRequest, reply: dict) -> int:
        start, size = reply.get("start_token"), reply.get("num_bytes")
        if start != request.start_token or not isinstance(size, int):
            raise TransferError(f"kv reply for start {start!r}, asked {request.start_token}")
        num_tokens = len(request.token_ids) - request.start_token
        bs = self.peer_desc.layout.block_size
        cap = container_size(self.peer_desc, num_tokens, -(-num_tokens // bs))
        if not 0 < size <= cap:
            raise MessageTooLargeError(f"kv reply announces {size} bytes; at most {cap} may come")
        return size

    def _payload(self, data: memoryview, request: FetchRequest, expected: list[bytes]) -> KVPayload:
        """The container in `data`, verified (every checksum; tensors are views of `data`)."""
        container = read_container(data, expect=self.desc.model)
        if container.desc != self.peer_desc:
            raise FormatError("the container's descriptor is not the negotiated one")
        check_identity(container, request, expected)

        tokens, hashes = tuple(container.token_ids), tuple(container.block_hashes)
        return KVPayload(request.start_token, tokens, hashes, container.cache)
