"""`RowArena`: memory for bulk entry rows (`[n, entry size]` bytes) that is reused, not fresh.

A tier read or a bulk encode of 64 SmolLM2 entries fills 23.6 MB. Fresh memory costs a page
fault per 4 KiB page on first touch (the kernel zeroes each page): measured 38 us of a 16-token
entry's 82 us disk fetch when every array was a fresh mapping, as inside vLLM's process, where
glibc rarely hands the same large block back. The arena keeps the buffers it handed out and
hands one out again once nothing refers to it any more: the rows it returns are a view of a
buffer, and every view, memoryview or tensor made from them holds the buffer, so a buffer only
the arena holds is free (CPython's reference count says so exactly). It holds at most
`max_bytes` of buffers; past that a request gets plain fresh memory.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_IDLE_REFS = 2  # sys.getrefcount(buffers[i]) of a buffer only the list holds: the list, the arg


class RowArena:
    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []  # uint8, 1-D, each owning its memory
        self._lock = threading.Lock()
        self.reused = 0  # requests served from a buffer already handed out before

    def rows(self, n: int, size: int) -> np.ndarray:
        """Uninitialised uint8 `[n, size]` rows (C order): a free buffer's, or fresh."""
        need = n * size
        with self._lock:
            free = [i for i in range(len(self._buffers)) if self._is_free(i)]
            fits = [i for i in free if len(self._buffers[i]) >= need]
            if fits:
                self.reused += 1
                best = min(fits, key=lambda i: len(self._buffers[i]))
                return self._buffers[best][:need].reshape(n, size)
            held = self.held_bytes
            for i in sorted(free, reverse=True):  # too small: make room for one that fits
                if held + need <= self.max_bytes:
                    break
                held -= len(self._buffers.pop(i))
            if held + need > self.max_bytes:
                return np.empty((n, size), dtype=np.uint8)
            self._buffers.append(np.empty(max(need, 1), dtype=np.uint8))
            return self._buffers[-1][:need].reshape(n, size)

    @property
    def held_bytes(self) -> int:
        return sum(len(b) for b in self._buffers)

    def _is_free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) == _IDLE_REFS


ROWS = RowArena()  # the process's: tier reads and bulk encodes share it
