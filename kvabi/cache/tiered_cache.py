"""`TieredCache`: the tiers below the pool. Blocks go down when they leave it; hits come back.

- Down: a cached block the pool evicts (its memory taken for another block), or an idle
  session's block (`demote`), is copied out of the KV storage on the step thread (one gather
  for all of them, before anything can overwrite it) and handed to the `TierWriter`, which
  encodes and stores it in every tier that lacks it (tiers are inclusive).
- Up: before a waiting request is scheduled, `promote` looks past its pooled prefix for the
  following blocks, in tier order (host, disk, Redis; the first that has a block serves it),
  loads the leading run it finds into free pool blocks and indexes them, so the scheduler's
  prefix match reuses them like any other cached block. Every entry is verified (checksums,
  model, block identity) before a byte is placed; one that fails is removed from its tier and
  the load stops there: the rest of the prompt is recomputed, never read from a bad entry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.errors import IncompatibleError
from kvabi.cache.block_codec import BlockCodec, stack_blocks
from kvabi.cache.block_pool import BlockKey
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.prefix_cache import PrefixCache
from kvabi.cache.tier import KVTier
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_writer import TierWriter

Plan = list[tuple[KVTier, BlockKey]]


class TieredCache:
    def __init__(
        self, config: TierConfig, prefix: PrefixCache, storage: KVStorage, tiers: list[KVTier]
    ) -> None:
        self.config = config
        self.prefix, self.pool, self.storage = prefix, prefix.pool, storage
        self.block_size = prefix.block_size
        self.tiers = tiers
        self.codec = BlockCodec(storage.desc)
        self.writer = TierWriter(tiers, self.codec, config.write_queue_bytes)
        self.block_bytes = storage.buffers.num_bytes // storage.num_blocks

    @classmethod
    def build(cls, config: TierConfig, prefix: PrefixCache, storage: KVStorage) -> TieredCache:
        """The configured tiers over this pool and storage."""
        return cls(config, prefix, storage, config.build(storage.desc.model.compat_digest()))

    def tier(self, name: str) -> KVTier:
        """The tier of this name (`host`, `disk`, `redis`)."""
        return next(t for t in self.tiers if t.name == name)

    def write_down_evicted(self) -> int:
        """Queue the blocks the pool evicted since the last call; return how many."""
        evicted = self.pool.pop_evicted()
        if evicted:
            self._submit([e.block_id for e in evicted], [e.key for e in evicted])
        return len(evicted)

    def demote(self, block_hashes: Sequence[bytes]) -> None:
        """Write down the pooled blocks among these hashes (an idle session's, head first) that
        some tier lacks, and put them all first in the pool's eviction order."""
        block_ids = self.prefix.pooled_blocks(block_hashes)
        keys = [self.pool.keys[i] for i in block_ids]
        held = [t.contains_many([k.block_hash for k in keys]) for t in self.tiers]
        todo = [j for j in range(len(keys)) if not all(h[j] for h in held)]
        if todo:
            self._submit([block_ids[j] for j in todo], [keys[j] for j in todo])
        self.pool.demote(block_ids)

    def promote(self, keys: Sequence[BlockKey]) -> int:
        """Load the blocks that follow the pooled prefix of `keys` from the tiers into free
        pool blocks, indexed and unreferenced; return the number of tokens loaded."""
        start = self.prefix.num_pooled([k.block_hash for k in keys])
        pooled = [self.pool.cached_block(k.block_hash) for k in keys[:start]]
        room = self.pool.num_free - self.pool.num_free_of(pooled)
        plan = self._plan(keys[start:])[: max(room, 0)]
        if not plan:
            return 0
        self.pool.touch(pooled)  # pinned: the allocation below must not evict them
        targets = self.pool.allocate(len(plan))
        num_loaded = 0
        try:
            self.write_down_evicted()  # what those blocks held goes down before it is overwritten
            num_loaded = self._load(plan, targets)
            for (_, key), block_id in zip(plan[:num_loaded], targets, strict=False):
                self.pool.cache_block(block_id, key)
        finally:  # whatever failed, the pins and the unfilled targets go back
            self.pool.free(pooled + targets)  # unloaded targets are empty and go first
        return num_loaded * self.block_size

    def flush(self) -> None:
        """Wait for queued write-downs (tests, benches, a second process about to read)."""
        self.writer.flush()

    def close(self) -> None:
        """Write what is queued, stop the writer, release the tiers' connections."""
        self.writer.close()
        for tier in self.tiers:
            tier.close()

    def _submit(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        n = self.writer.reserve(len(block_ids), self.block_bytes)  # before copying anything
        if n:
            snapshot = self.storage.read_blocks(block_ids[:n])
            self.writer.submit(snapshot, keys[:n], n * self.block_bytes)

    def _plan(self, keys: Sequence[BlockKey]) -> Plan:
        """The leading run of blocks some tier holds, each from the first tier holding it."""
        if not keys or not self.tiers:
            return []
        present = self._present([k.block_hash for k in keys])
        plan: Plan = []
        asked = [0] * len(self.tiers)
        for i, key in enumerate(keys):
            owner = next((j for j, p in enumerate(present) if i in p), None)
            for j in range(len(self.tiers) if owner is None else owner + 1):
                asked[j] += 1
            if owner is None:
                break
            plan.append((self.tiers[owner], key))
        for tier, n in zip(self.tiers, asked, strict=True):
            if n:
                tier.stats.add(queries=1, query_tokens=n * self.block_size)
        return plan

    def _present(self, hashes: list[bytes]) -> list[set[int]]:
        """Per tier, which of the hashes it holds; each tier is asked only about the ones the
        tiers before it lack (a remote round trip is saved when host RAM has them all)."""
        present, missing = [], list(range(len(hashes)))
        for tier in self.tiers:
            found = tier.contains_many([hashes[i] for i in missing]) if missing else []
            present.append({i for i, f in zip(missing, found, strict=True) if f})
            missing = [i for i, f in zip(missing, found, strict=True) if not f]
        return present

    def _load(self, plan: Plan, targets: list[int]) -> int:
        """Fetch, verify and place the planned blocks, tier run by tier run; stop at the first
        block that cannot be loaded. Returns how many leading blocks were placed."""
        done = 0
        for tier, run in _runs(plan):
            start = time.perf_counter()
            entries = tier.get_many([k.block_hash for k in run])
            caches = []
            for key, entry in zip(run, entries, strict=True):
                cache = self._decode(tier, key, entry)
                if cache is None:
                    break
                caches.append(cache)
            self._place(caches, targets[done : done + len(caches)])
            done += len(caches)
            seconds = time.perf_counter() - start
            tier.stats.add(loads=1, load_seconds=seconds, hit_tokens=len(caches) * self.block_size)
            if len(caches) < len(run):
                break
        return done

    def _decode(self, tier: KVTier, key: BlockKey, entry: bytes | None) -> CacheBuffers | None:
        if entry is None:
            return None
        try:
            return self.codec.decode(entry, key)
        except IncompatibleError:
            tier.stats.add(refused=1)
        except Exception:  # KvabiError, or bytes no reader expects: never loaded either way
            tier.stats.add(corrupt=1)
        tier.remove(key.block_hash)
        return None

    def _place(self, caches: list[CacheBuffers], block_ids: list[int]) -> None:
        """Write decoded blocks into the pool: own-layout runs in one conversion, others alone."""
        own = [c for c in caches if c.desc == self.storage.desc]
        if len(own) == len(caches) and caches:
            self.storage.write_blocks(stack_blocks(caches), block_ids)
            return
        for cache, block_id in zip(caches, block_ids, strict=True):
            self.storage.write_blocks(cache, [block_id])


def _runs(plan: Plan) -> Iterator[tuple[KVTier, list[BlockKey]]]:
    """Consecutive plan entries served by the same tier."""
    i = 0
    while i < len(plan):
        j = i
        while j < len(plan) and plan[j][0] is plan[i][0]:
            j += 1
        yield plan[i][0], [k for _, k in plan[i:j]]
        i = j
