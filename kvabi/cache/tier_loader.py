"""`TierLoader`: reads from the tiers below host RAM off the step thread.

A waiting request whose prefix continues on disk or in Redis would stall every running request
for as long as its entries take to read and verify. Instead the loader reads them on its own
thread (`TieredCache.fetch`: verified, copied into the pool's entry layout) while the request
waits (the scheduler passes over it; the others run); once the read is done, the step thread
places the blocks into the pool (`place`), as cached blocks, and the request is admitted with
its prefix held. A run that host RAM holds whole loads at once instead (`KVCache.held`: a copy
at memory speed, under the host tier's lock).

The pool may change while a read is under way: at placement the pooled prefix is looked up
again, and only the blocks that extend it (and fit) are placed; the rest is recomputed. A read
that fails loads nothing (the tier counted and logged it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.block_codec import narrow_blocks
from kvabi.cache.block_hasher import BlockKey

if TYPE_CHECKING:
    from kvabi.cache.kv_cache import KVCache

log = logging.getLogger("kvabi.cache")


@dataclass
class PendingLoad:
    """A read under way: the prompt's full blocks, the first one read, the blocks read."""

    keys: list[BlockKey]
    start: int
    future: Future[CacheBuffers | None]

    @property
    def is_done(self) -> bool:
        return self.future.done()


class TierLoader:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvabi-tier-loader")

    def start(self, keys: Sequence[BlockKey]) -> PendingLoad | None:
        """Load the run after the pooled prefix of `keys`: at once when host RAM holds it all
        (None), else on the loader's thread (the pending load; `place` it once done)."""
        cache, keys = self.cache, list(keys)
        n = cache.num_pooled([k.block_hash for k in keys])
        if n == len(keys):
            return None
        if cache.tiers.in_memory(keys[n:]) == len(keys) - n:
            cache.held(keys)
            return None
        pooled = cache.pooled_ids([k.block_hash for k in keys[:n]])
        room = max(cache.pool.num_free - cache.pool.num_free_of(pooled), 0)
        return PendingLoad(keys, n, self._thread.submit(cache.tiers.fetch, keys[n:], room))

    def place(self, load: PendingLoad) -> int:
        """Place a finished read's blocks that extend the pool's prefix now (those that fit);
        returns how many were placed."""
        try:
            staged = load.future.result()
        except Exception:  # a tier's own failures never raise: this is a bug, not an outage
            log.exception("kvabi: a read from the lower tiers failed")
            return 0
        if staged is None:
            return 0
        cache, hashes = self.cache, [k.block_hash for k in load.keys]
        n = cache.num_pooled(hashes)
        end = load.start + staged.extent
        if not load.start <= n < end:  # the prefix before it went, or the pool has it all
            return 0
        pooled = cache.pooled_ids(hashes[:n])
        room = cache.pool.num_free - cache.pool.num_free_of(pooled)
        take = min(end - n, room)
        if take <= 0:
            return 0
        blocks = narrow_blocks(staged, n - load.start, take)
        return cache.place(pooled, load.keys[n : n + take], blocks)

    def close(self) -> None:
        """Finish the reads under way."""
        self._thread.shutdown(wait=True)
