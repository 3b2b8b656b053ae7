"""The `nixl` transport's data plane: a container moves as a sequence of windows.

The prefill side writes the container (docs/ABI.md, section 5) into registered slots
(`WindowSink`); each full slot is published with a `window {slot, len}` control message, the
decode side READs it into its own registered slot and answers `ack {w}`, and only then is the
slot written again. With `depth` slots per transfer the next window is staged while the last
one is read. The decode side (`WindowReader`) copies each window to its place in one buffer of
the announced size; `read_container` then verifies every checksum in place, so corrupt bytes
never become a payload. Every wait has a timeout: a socket read (io timeout), a READ (io
timeout), the whole transfer (transfer timeout).
"""

from __future__ import annotations

import socket
import time

import numpy as np

from kvabi.transfer.errors import MessageTooLargeError, TransferError, TransferTimeoutError
from kvabi.transfer.framing import expect, recv_msg, send_msg
from kvabi.transfer.nixl_memory import Arena, ArenaInfo
from kvabi.transfer.nixl_read import nixl_read


class WindowSink:
    """A write-only sink for `write_container` that stages into `slots` of `arena`."""

    def __init__(
        self,
        conn: socket.socket,
        arena: Arena,
        slots: list[int],
        deadline_s: float,
    ) -> None:
        self.conn, self.arena, self.slots = conn, arena, slots
        self.deadline = time.monotonic() + deadline_s
        self.num_windows = self.num_acked = self.fill = self.pos = 0
        self._slot = arena.slot(slots[0]).numpy()  # the window being filled

    def write(self, data: bytes | memoryview) -> int:
        """Copy `data` into the current slot, publishing each slot as it fills."""
        view = np.frombuffer(data, dtype=np.uint8)  # [n] bytes, no copy
        done = 0
        while done < len(view):
            if self.fill == len(self._slot):
                self._publish()
            n = min(len(view) - done, len(self._slot) - self.fill)
            self._slot[self.fill : self.fill + n] = view[done : done + n]
            self.fill, self.pos, done = self.fill + n, self.pos + n, done + n
        return len(view)

    def publish(self) -> None:
        """Publish what the current slot holds now (a layer's tail), if anything."""
        if self.fill:
            self._publish()

    def finish(self) -> None:
        """Publish the last window and wait until every window is read."""
        self.publish()
        while self.num_acked < self.num_windows:
            self._wait_ack()

    def _publish(self) -> None:
        if time.monotonic() > self.deadline:
            raise TransferTimeoutError("transfer deadline passed while sending")
        slot = self.slots[self.num_windows % len(self.slots)]
        send_msg(self.conn, {"t": "window", "slot": slot, "len": self.fill})
        self.num_windows += 1
        self.fill = 0
        while self.num_windows - self.num_acked >= len(self.slots):  # next slot still lent
            self._wait_ack()
        next_slot = self.slots[self.num_windows % len(self.slots)]
        self._slot = self.arena.slot(next_slot).numpy()

    def _wait_ack(self) -> None:
        msg = expect(recv_msg(self.conn, 4096), "ack")
        if msg.get("w") != self.num_acked:
            raise TransferError(f"ack for window {msg.get('w')!r}, expected {self.num_acked}")
        self.num_acked += 1


class WindowReader:
    """The decode side: READs each published window into `local_slot` of `arena`, then copies
    it to its place in the container's buffer; `limit` bytes in all, no more."""

    def __init__(
        self,
        conn: socket.socket,
        arena: Arena,
        local_slot: int,
        peer: ArenaInfo,
        timeouts: tuple[float, float],  # (per window, whole transfer)
    ) -> None:
        self.conn, self.arena, self.peer = conn, arena, peer
        self.local = arena.slot(local_slot)  # [slot_bytes] uint8
        self.io_timeout_s = timeouts[0]
        self.deadline = time.monotonic() + timeouts[1]
        self.num_windows = 0

    def read_all(self, out: np.ndarray) -> None:
        """Fill `out` ([num_bytes] uint8, the announced container size) window by window."""
        pos, local = 0, self.local.numpy()
        while pos < len(out):
            size = self._pull(len(out) - pos)
            out[pos : pos + size] = local[:size]
            pos += size

    def _pull(self, left: int) -> int:
        msg = expect(recv_msg(self.conn, 4096), "window")
        slot, size = msg.get("slot"), msg.get("len")
        if not isinstance(slot, int) or not 0 <= slot < self.peer.num_slots:
            raise TransferError(f"window in slot {slot!r}; the peer has {self.peer.num_slots}")
        cap = min(self.peer.slot_bytes, self.local.numel(), left)
        if not isinstance(size, int) or not 0 < size <= cap:
            raise MessageTooLargeError(f"window of {size!r} bytes; at most {cap} may come")
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            raise TransferTimeoutError("the fetch passed its transfer timeout")
        remote = self.peer.base + slot * self.peer.slot_bytes
        read_s = min(self.io_timeout_s, left_s)
        nixl_read(
            self.arena.agent, self.peer.agent_name, self.local.data_ptr(), remote, size, read_s
        )
        send_msg(self.conn, {"t": "ack", "w": self.num_windows})
        self.num_windows += 1
        return size
