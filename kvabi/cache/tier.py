"""`KVTier`: a store of blocks below the engine's pool (host RAM, local disk, a shared Redis).

Every tier holds *entries*: one block as an ABI container (its descriptor, its tokens, its block
hash, its K/V; `BlockCodec`), keyed by the portable block hash. A tier stores and returns bytes
and never interprets them: checksums, the model check and layout conversion happen once, in
`TieredCache`, whatever tier an entry came from. The host tier (`holds_blocks`) keeps the
engine's blocks as tensors instead: they never leave the process (kvabi/cache/host_tier.py).
Each tier has a capacity in bytes and evicts its own least recently used entries to stay
under it.

A tier may fail (a remote store goes away, a value in it is not what this code wrote): any
exception from a tier's own code is a tier failure. The public methods catch it, count it, log
the outage once (an outage lasts until a call succeeds again, however many retries fail) and
mark the tier down for `retry_s` seconds, during which it answers "absent" at once; the caller
carries on with the tiers that are left. A request never fails because of
a tier, and no exception from one reaches the step loop.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TypeVar

import numpy as np

from kvabi.wire.entries import RowSums

log = logging.getLogger("kvabi.cache")
T = TypeVar("T")


@dataclass
class TierStats:
    """Counters of one tier. `add` is thread-safe (the write-down thread updates them too)."""

    queries: int = 0  # lookups that reached this tier
    query_tokens: int = 0  # tokens asked of it (blocks the tiers above did not have)
    hit_tokens: int = 0  # tokens loaded from it into the pool
    loads: int = 0  # load calls (one per request whose prefix it served)
    load_seconds: float = 0.0  # time spent in them: fetch, verify, convert, place
    writes: int = 0  # entries written
    write_bytes: int = 0
    evictions: int = 0  # entries dropped by its LRU to stay under capacity
    failures: int = 0  # operations that failed (e.g. Redis unreachable)
    corrupt: int = 0  # entries that failed their checksum or format: removed, never loaded
    refused: int = 0  # entries of another model: removed, never loaded
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """Add to the named counters, atomically."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def counters(self) -> dict[str, float]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class KVTier(ABC):
    """One storage tier. Methods are thread-safe: the step loop reads while a writer writes.

    Subclasses implement the underscored methods and may raise from them; the public ones
    turn any exception into a failure (see the module docstring)."""

    name: str
    holds_blocks = False  # keeps blocks as tensors too (`put_blocks`, `load_blocks`: HostTier)

    def __init__(self, capacity_bytes: int, retry_s: float = 1.0) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"{self.name} tier capacity: must be >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.retry_s = retry_s
        self.stats = TierStats()
        self._down_until = 0.0
        self._is_outage = False  # from a failure to the next success
        self._down_lock = threading.Lock()

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """Bytes of the entries held (for a shared store: as last seen by this process)."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Entries held (for a shared store: as last seen by this process)."""

    @property
    def is_down(self) -> bool:
        """Whether the tier is marked down after a failure (it then answers "absent" at once)."""
        return time.monotonic() < self._down_until

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash has an entry (without touching its LRU position)."""
        absent = [False] * len(block_hashes)
        return self._guard(lambda: self._contains_many(block_hashes), absent) if absent else []

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each hash's entry (unverified bytes) or None; found entries become most recent."""
        absent: list[bytes | None] = [None] * len(block_hashes)
        return self._guard(lambda: self._get_many(block_hashes), absent) if absent else []

    def read_rows(
        self, block_hashes: Sequence[bytes], rows: np.ndarray, sums: RowSums | None = None
    ) -> int:
        """Read the leading entries of `block_hashes` that are exactly `rows.shape[1]` bytes
        long into the rows of `rows` (unverified; their LRU positions refreshed); how many.
        A tier that can take the entries' checksums as it reads them fills `sums.out`."""
        if not block_hashes:
            return 0
        return self._guard(lambda: self._read_rows(block_hashes, rows, sums), 0)

    def _read_rows(
        self, block_hashes: Sequence[bytes], rows: np.ndarray, sums: RowSums | None
    ) -> int:
        """A tier that reads into memory of its own copies each entry over (Redis); the disk
        tier reads straight into the rows."""
        n = 0
        for entry in self._get_many(block_hashes[: len(rows)]):
            if entry is None or len(entry) != rows.shape[1]:
                break
            rows[n] = np.frombuffer(entry, dtype=np.uint8)
            n += 1
        return n

    def put(self, block_hash: bytes, entry: bytes | memoryview) -> None:
        """Store an entry (a no-op when present), evicting the least recent to fit. A view
        (`seal_entries`) is read before this returns, or copied."""
        if len(entry) <= self.capacity_bytes:  # else it would evict everything, then not fit
            self._guard(lambda: self._put(block_hash, entry), None)

    def remove(self, block_hash: bytes) -> None:
        """Drop an entry (a corrupt or foreign one) if present."""
        self._guard(lambda: self._remove(block_hash), None)

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to release
        """Release connections or handles."""

    def _guard(self, op: Callable[[], T], absent: T) -> T:
        if self.is_down:
            return absent
        try:
            result = op()
        except Exception as exc:
            self._failed(exc)
            return absent
        self._is_outage = False
        return result

    def _failed(self, exc: Exception) -> None:
        with self._down_lock:
            was_up, self._is_outage = not self._is_outage, True
            self._down_until = time.monotonic() + self.retry_s
        self.stats.add(failures=1)
        if was_up:
            log.warning(
                "kvabi: %s tier failed (%s: %s); its blocks are misses for %.1f s",
                self.name,
                type(exc).__name__,
                exc,
                self.retry_s,
            )

    @abstractmethod
    def _contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def _get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]: ...

    @abstractmethod
    def _put(self, block_hash: bytes, entry: bytes | memoryview) -> None: ...

    @abstractmethod
    def _remove(self, block_hash: bytes) -> None: ...
