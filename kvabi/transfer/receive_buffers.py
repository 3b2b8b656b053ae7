"""`ReceiveBuffers`: the decode side's reusable buffers that containers are received into.

A fetch receives its container straight into one buffer and returns tensors that are views of
it (no copy after the socket's). Fresh allocations cost about 4x a warm buffer here (page
faults on first touch, see machine-facts), so buffers are kept and handed out again, but only
once nothing refers to them any more: every tensor viewing a buffer keeps its numpy array
alive (`torch.frombuffer` holds the memoryview, which holds the array), so the array's
reference count says whether a payload from it is still in use (CPython counts references
exactly). A buffer still in use is never handed out; a new one is made instead.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_UNUSED_REFS = 2  # the pool's list and getrefcount's own argument


class ReceiveBuffers:
    """At most `max_buffers` kept, each at most `max_bytes`; larger containers get a buffer
    of their own that is freed with their tensors."""

    def __init__(self, max_buffers: int = 2, max_bytes: int = 1 << 30) -> None:
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> memoryview:
        """A writable buffer of exactly `num_bytes` (the caller checked the size first)."""
        with self._lock:
            index = self._free_index(num_bytes)
            if index is None:
                index = self._make(num_bytes)
            if index is None:
                return memoryview(np.empty(num_bytes, np.uint8))  # not kept
            return memoryview(self._arrays[index])[:num_bytes]

    @property
    def num_kept(self) -> int:
        return len(self._arrays)

    def _free_index(self, num_bytes: int) -> int | None:
        for i in range(len(self._arrays)):
            if len(self._arrays[i]) >= num_bytes and self._is_unused(i):
                return i
        return None

    def _is_unused(self, index: int) -> bool:
        return sys.getrefcount(self._arrays[index]) <= _UNUSED_REFS

    def _make(self, num_bytes: int) -> int | None:
        """Keep a new buffer: in a free slot, else in place of an unused smaller one."""
        if num_bytes > self.max_bytes:
            return None
        array = np.empty(num_bytes, np.uint8)  # not zeroed: every byte is received before use
        if len(self._arrays) < self.max_buffers:
            self._arrays.append(array)
            return len(self._arrays) - 1
        for i in range(len(self._arrays)):
            if self._is_unused(i):
                self._arrays[i] = array
                return i
        return None
