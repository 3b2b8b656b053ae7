"""`KVTier`: a store of blocks below the engine's pool (host RAM, local disk, a shared Redis).

Every tier holds *entries*: one block as an ABI container (its descriptor, its tokens, its block
hash, its K/V; `BlockCodec`), keyed by the portable block hash. A tier stores and returns bytes
and never interprets them: checksums, the model check and layout conversion happen once, in
`TieredCache`, whatever tier an entry came from. Each tier has a capacity in bytes and evicts its
own least recently used entries to stay under it.

A tier may fail (a remote store goes away): its methods then answer "absent" and count the
failure instead of raising, so a request never fails because of a tier.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields


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
    """One storage tier. Methods are thread-safe: the step loop reads while a writer writes."""

    name: str

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"{self.name} tier capacity: must be >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

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
        """Whether the tier is marked unreachable (it then answers "absent" at once)."""
        return False

    @abstractmethod
    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash has an entry (without touching its LRU position)."""

    @abstractmethod
    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each hash's entry (unverified bytes) or None; found entries become most recent."""

    @abstractmethod
    def put(self, block_hash: bytes, entry: bytes) -> None:
        """Store an entry (a no-op when present), evicting the least recent to fit."""

    @abstractmethod
    def remove(self, block_hash: bytes) -> None:
        """Drop an entry (a corrupt or foreign one) if present."""

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to release
        """Release connections or handles."""
