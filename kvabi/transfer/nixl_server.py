"""The `nixl` transport's prefill side: authenticated control connections, NIXL data plane.

A connection handshakes exactly as on TCP (handshake.py: challenge-response on the shared
secret, then descriptors); only then does it answer `nixl_hello` with this server's NIXL
agent metadata and arena, so a peer that fails the challenge learns nothing that would let it
READ. Then it serves `fetch` messages one at a time: the provider prefills, the container is
staged into registered slots borrowed from the arena and published window by window
(nixl_windows.py), a layer at a time when the provider streams them (`KVStream`); the slots
go back once every window was acknowledged (or on any error). A provider failure is answered
with an `error` message; the connection stays usable.

A fetch that `reads_blocks` may get a loan of the pool's blocks instead (the pool given to
`listen`, its buffers registered with the agent once): a `blocks` message names the blocks and
where each buffer lies; a `sums` message follows with each buffer's checksum over those blocks
(pool_regions.py), taken while the asker READs them (into its own pool, or into staging
buffers when its layout differs: lent_blocks.py). It answers `done`; only then is the loan
released, so the blocks cannot change under the READ. The pool is readable by authenticated
peers only (they learn its addresses after the handshake), as vLLM's NixlConnector exposes its
KV cache to its peers.
"""

from __future__ import annotations

import logging
import socket

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.errors import TransferError, TransferTimeoutError
from kvabi.transfer.fetch_loop import sections, serve_fetches
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.kv_listener import KVListener
from kvabi.transfer.nixl_memory import Arena, PoolRegistry, make_agent
from kvabi.transfer.nixl_windows import WindowSink
from kvabi.transfer.pool_regions import block_sums
from kvabi.transfer.transport import (
    KVLoan,
    KVServer,
    KVStream,
    StreamProvider,
    TransportConfig,
)
from kvabi.wire.container_format import container_size
from kvabi.wire.container_writer import ContainerWriter

log = logging.getLogger("kvabi.disagg")


class NixlKVServer(KVServer):
    def __init__(
        self,
        config: TransportConfig,
        address: str,
        desc: Descriptor,
        provider: StreamProvider,
        arena_shape: tuple[int, int],  # (slot_bytes, num_slots)
        depth: int = 2,
        pool: CacheBuffers | None = None,  # whose blocks `provider` may lend
    ) -> None:
        self.config, self.desc, self.provider, self.depth = config, desc, provider, depth
        self.agent = make_agent("prefill")
        self.arena = Arena(self.agent, *arena_shape)
        self._pools = PoolRegistry(self.agent)
        self._lent = pool  # registered now, before any peer loads our metadata
        self._lent_regions = self._pools.regions(pool) if pool is not None else []
        self._listener = KVListener(address, config, desc, self._serve, "kvabi-nixl-accept")
        self._listener.start()

    @property
    def address(self) -> str:
        return self._listener.address

    def close(self) -> None:
        if self._listener.is_closed:
            return
        self._listener.close()
        self.arena.close()
        self._pools.close()

    def _serve(self, conn: socket.socket) -> None:
        """An authenticated connection (KVListener did the handshake); errors end it."""
        expect(recv_msg(conn, 4096), "nixl_hello")
        md = self.agent.get_agent_metadata()
        send_msg(conn, {"t": "nixl_md", "md": md, **self.arena.info().to_msg()})
        send, lend = self._send, (self._lend if self._lent is not None else None)
        serve_fetches(conn, self.config, self.desc, self.provider, send, self._is_closed, lend)

    def _is_closed(self) -> bool:
        return self._listener.is_closed

    def _send(
        self, conn: socket.socket, stream: KVStream, first: LayerBuffers, is_live: bool
    ) -> None:
        """The `kv` message, then the container through the slots. A live stream publishes
        each layer's tail as it is written, so layer l is read while l + 1 is computed."""
        num_tokens, num_hashes = len(stream.token_ids), len(stream.block_hashes)
        size = container_size(stream.desc, num_tokens, num_hashes)
        num_windows = -(-size // self.arena.slot_bytes)
        try:
            slots = self.arena.acquire(min(self.depth, num_windows), self.config.io_timeout_s)
        except TransferTimeoutError as exc:
            send_msg(conn, {"t": "error", "kind": "busy", "msg": str(exc)})
            return
        try:
            send_msg(conn, {"t": "kv", "start_token": stream.start_token, "num_bytes": size})
            sink = self._sink(conn, slots, stream)
            writer = ContainerWriter(sink, stream.desc, stream.token_ids, stream.block_hashes)
            for section in sections(writer, stream, first, is_live):
                writer.write_prepared(section)
                if is_live:
                    sink.publish()
            writer.close()
            sink.finish()
        finally:
            self.arena.release(slots)

    def _lend(self, conn: socket.socket, loan: KVLoan) -> None:
        """The `blocks` message, then wait (up to the transfer timeout) for the asker's
        `done`; the loan is released whatever happens."""
        try:
            if loan.buffers is not self._lent:
                raise TransferError("a loan of a pool not given to listen(): peers cannot READ it")
            regions = self._lent_regions
            msg = {
                "t": "blocks",
                "start_token": loan.start_token,
                "num_tokens": len(loan.token_ids),
                "block_hashes": list(loan.block_hashes),
                "block_ids": list(loan.block_ids),
                "regions": [r.to_msg() for r in regions],
            }
            send_msg(conn, msg)
            sums = block_sums(loan.buffers, loan.block_ids)  # while the asker READs
            send_msg(conn, {"t": "sums", "sums": [sums[r.key] for r in regions]})
            conn.settimeout(self.config.transfer_timeout_s)
            expect(recv_msg(conn, 4096), "done")
            conn.settimeout(self.config.io_timeout_s)
        finally:
            loan.release()

    def _sink(self, conn: socket.socket, slots: list[int], stream: KVStream) -> WindowSink:
        """Where a stream's container bytes go (a seam: tests/transfer/faults.py stages them
        otherwise)."""
        return WindowSink(conn, self.arena, slots, self.config.transfer_timeout_s)


LayerBuffers = tuple[int, dict[str, torch.Tensor]]
