"""`KVCache`: the one owner of an engine's KV cache, behind a small block API.

It owns the block pool (ids, ref counts, the index of cached blocks by hash), the KV storage
(the tensors), the tiers below the pool and the block-event sink. Everyone outside
`kvabi/cache` and `kvabi/engine` goes through the block API, in tokens and block hashes, never
block ids:
- `hasher`: a prompt's block hashes and keys (the one root rule: model digest + cache_salt);
- `held`: how many leading blocks of a prompt the cache holds: the pool's run, extended by
  loading the run after it from the tiers;
- `export` / `export_layer`: blocks as `CacheBuffers` with their hashes and tokens;
- `import_blocks`: verified blocks placed into the pool as cached blocks, so the next request
  with that prefix hits them.
Blocks the pool evicts are written down the tiers inside allocation (`BlockPool.write_down`), so
no path that allocates can give a tier the wrong KV under an old hash. The scheduler (in
`kvabi/engine`) also uses the pool directly for its ref counts and block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvabi.abi.buffers import CacheBuffers, layer_buffer_specs
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_codec import stack_blocks
from kvabi.cache.block_events import BlockEventSink
from kvabi.cache.block_hasher import BlockHasher, BlockKey
from kvabi.cache.block_pool import BlockPool
from kvabi.cache.cache_stats import CacheStats, flat_stats
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tiered_cache import TieredCache


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a request: its tokens and the pool blocks holding them."""

    num_cached_tokens: int
    block_ids: tuple[int, ...]


NO_MATCH = MatchResult(0, ())


@dataclass(frozen=True)
class FetchRequest:
    """KV wanted for `token_ids` (a whole prompt) from token `start_token` on; the blocks
    before it the asker already holds. `start_token` is a multiple of both block sizes."""

    token_ids: tuple[int, ...]
    start_token: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class KVPayload:
    """Blocks of a prompt's KV: tokens `start_token .. start_token + len(token_ids) - 1` in
    the sender's layout (`cache.extent` blocks), with the sender's block hashes of them."""

    start_token: int
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    cache: CacheBuffers

    @property
    def end_token(self) -> int:
        """One past the last token whose KV the payload holds."""
        return self.start_token + len(self.token_ids)


@dataclass(frozen=True)
class ImportResult:
    """What an import did: tokens the pool now holds for the prompt, blocks newly placed."""

    num_cached_tokens: int
    num_placed_blocks: int


class KVCache:
    def __init__(
        self,
        desc: Descriptor,
        num_blocks: int,
        prefix_caching: bool = True,
        tiers: TierConfig = TierConfig(),
        events: BlockEventSink | None = None,
    ) -> None:
        """`desc`: the storage's layout (a paged preset of the model); `events`: told of every
        change to the index of cached blocks (KV events for prefix-aware routers). Tiers
        hold cached blocks, so they need `prefix_caching` (EngineConfig checks)."""
        self.desc, self.block_size = desc, desc.layout.block_size
        self.is_prefix_caching = prefix_caching
        self.storage = KVStorage(desc, num_blocks)
        self.hasher = BlockHasher(desc.model.compat_digest(), self.block_size)
        self.tiers = TieredCache.build(tiers, self.storage) if tiers.is_enabled else None
        write_down = self.tiers.write_down if self.tiers is not None else None
        self.pool = BlockPool(num_blocks, events, write_down)
        self.stats = CacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def block_bytes(self) -> int:
        return self.storage.buffers.num_bytes // self.num_blocks

    # ---- the index of cached blocks (the scheduler's prefix match) ----

    def num_pooled(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of `hashes` the pool holds."""
        for n, h in enumerate(hashes):
            if self.pool.cached_block(h) is None:
                return n
        return len(hashes)

    def match(self, hashes: Sequence[bytes], num_tokens: int) -> MatchResult:
        """The longest pooled prefix of a sequence of `num_tokens` tokens, capped at
        `num_tokens - 1` tokens (the last token's logits choose the next). A capped last block
        is still returned: the caller copies it on write and recomputes only the last token."""
        num_cached = min(self.num_pooled(hashes) * self.block_size, num_tokens - 1)
        if num_cached <= 0:
            return NO_MATCH
        n = -(-num_cached // self.block_size)
        return MatchResult(num_cached, tuple(self.pool.cached_block(h) for h in hashes[:n]))

    def cache_blocks(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int],
        start: int, stop: int,
    ) -> None:  # fmt: skip
        """Index a sequence's blocks `start .. stop-1` (full and computed) under their keys."""
        keys = self.hasher.keys_of(hashes, token_ids, start, stop)
        for block_id, key in zip(block_ids[start:stop], keys, strict=True):
            self.pool.cache_block(block_id, key)

    def demote(self, hashes: Sequence[bytes]) -> None:
        """An idle session's blocks (head first): write down the pooled ones some tier lacks
        and put them all first in the pool's eviction order."""
        block_ids = self._pooled_ids(hashes)
        if self.tiers is not None:
            keys = [self.pool.keys[i] for i in block_ids]
            todo = self.tiers.lacking(keys)
            if todo:
                self.tiers.write_down([block_ids[j] for j in todo], [keys[j] for j in todo])
        self.pool.demote(block_ids)

    # ---- the block API ----

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` the pool holds, after loading the run that follows
        its pooled prefix from the tiers (verified; loaded blocks are cached, unreferenced)."""
        n = self.num_pooled([k.block_hash for k in keys])
        if self.tiers is None or n == len(keys):
            return n
        pooled = self._pooled_ids([k.block_hash for k in keys[:n]])
        room = self.pool.num_free - self.pool.num_free_of(pooled)
        found = self.tiers.fetch(keys[n:], max(room, 0))
        if found:
            self._place(pooled, list(keys[n : n + len(found)]), found)
        return n + len(found)

    def export(
        self, token_ids: Sequence[int], cache_salt: str | None, start_token: int = 0
    ) -> KVPayload:
        """A copy of the prompt's pooled blocks from `start_token` (a block boundary) up to
        the first one the pool lacks, in this cache's layout."""
        hashes = self.hasher.hashes(token_ids, cache_salt)
        first = start_token // self.block_size
        num_blocks = max(self.num_pooled(hashes) - first, 0)
        block_ids = self._pooled_ids(hashes[first : first + num_blocks])
        cache = self.storage.read_blocks(block_ids)  # [num_blocks] blocks, own layout
        tokens = tuple(token_ids[start_token : (first + num_blocks) * self.block_size])
        return KVPayload(start_token, tokens, tuple(hashes[first : first + num_blocks]), cache)

    def export_layer(self, layer_id: int, block_ids: Sequence[int]) -> dict[str, Tensor]:
        """A copy of one layer of these blocks, in this cache's layout: that layer's section
        of a container of them (called mid-forward, once the layer's K/V are stored)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        tensors = self.storage.buffers.tensors
        return {
            spec.key: tensors[spec.key].index_select(spec.dim("B"), index)
            for spec in layer_buffer_specs(self.desc, layer_id, len(block_ids))
        }

    def import_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None, payload: KVPayload
    ) -> ImportResult:
        """Place `payload`'s blocks of the prompt `token_ids` (any layout of this model, this
        cache's block size) into free pool blocks, cached under this cache's own hashes.
        Blocks that would not extend the pooled prefix are not placed (nothing could reach
        them); blocks the pool already holds are not placed twice."""
        if not self.is_prefix_caching:
            raise ValueError("importing blocks needs the prefix cache (enable_prefix_caching)")
        bs, hashes = self.block_size, self.hasher.hashes(token_ids, cache_salt)
        held = self.num_pooled(hashes)
        first, last = payload.start_token // bs, min(payload.end_token // bs, len(hashes))
        pooled = self._pooled_ids(hashes[:held])
        last = min(last, first + self.pool.num_free - self.pool.num_free_of(pooled))
        if payload.start_token % bs or held < first or last <= held:
            return ImportResult(held * bs, 0)
        keys = self.hasher.keys_of(hashes, token_ids, first, last)
        return ImportResult(last * bs, self._place(pooled, keys, [payload.cache]))

    # ---- housekeeping ----

    def flat_stats(self) -> dict[str, float]:
        """Prefix cache and tier metrics as flat `name -> value` (kvabi/cache/cache_stats.py)."""
        tiers = self.tiers.tiers if self.tiers else []
        writer = self.tiers.writer if self.tiers else None
        return flat_stats(self.stats, self.pool, self.block_bytes, tiers, writer)

    def flush(self) -> None:
        """Wait until every queued write-down has reached the lower tiers."""
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        """Finish queued write-downs and release the tiers (their connections and thread)."""
        if self.tiers is not None:
            self.tiers.close()

    def _pooled_ids(self, hashes: Sequence[bytes]) -> list[int]:
        """The pool blocks still holding any of these hashes, in the given order."""
        found = (self.pool.cached_block(h) for h in hashes)
        return [b for b in found if b is not None]

    def _place(self, pooled: list[int], keys: list[BlockKey], caches: list[CacheBuffers]) -> int:
        """Write `caches`' blocks (in order, `len(keys)` in all) into new pool blocks indexed
        under `keys`, the prefix blocks `pooled` pinned meanwhile (so allocating cannot evict
        them); returns how many were new. All end up free: cached, or empty when the pool
        already held that hash."""
        self.pool.touch(pooled)
        targets: list[int] = []
        try:
            targets = self.pool.allocate(len(keys))  # evicted blocks are written down inside
            if len(caches) > 1 and all(c.desc == caches[0].desc for c in caches):
                caches = [stack_blocks(caches)]  # one conversion for the run
            if len(caches) == 1:
                self.storage.write_blocks(caches[0], targets)  # converts layout and block size
            else:
                for cache, block_id in zip(caches, targets, strict=True):
                    self.storage.write_blocks(cache, [block_id])
            return sum(self.pool.cache_block(b, k) for b, k in zip(targets, keys, strict=True))
        finally:
            self.pool.free(pooled + targets)
