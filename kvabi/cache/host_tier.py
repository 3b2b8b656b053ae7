"""`HostTier`: entries in host RAM, an LRU bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvabi.cache.tier import KVTier


class HostTier(KVTier):
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # least recent first
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def _contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [h in self._entries for h in block_hashes]

    def _get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        out = []
        with self._lock:
            for h in block_hashes:
                entry = self._entries.get(h)
                if entry is not None:
                    self._entries.move_to_end(h)
                out.append(entry)
        return out

    def _put(self, block_hash: bytes, entry: bytes) -> None:
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return
            self._entries[block_hash] = entry
            self._num_bytes += len(entry)
            evicted = 0
            while self._num_bytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._num_bytes -= len(old)
                evicted += 1
        self.stats.add(writes=1, write_bytes=len(entry), evictions=evicted)

    def _remove(self, block_hash: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(block_hash, None)
            if entry is not None:
                self._num_bytes -= len(entry)

    def lru_order(self) -> list[bytes]:
        """Hashes from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._entries)
