"""`KVCache`: the one owner of an engine's KV cache, behind a small block API.

It owns the block pool (ids, ref counts, the index of cached blocks by hash), the KV storage
(the tensors), the tiers below the pool and the block-event sink. Everyone outside
`kvabi/cache` and `kvabi/engine` goes through the block API, in tokens and block hashes, never
block ids:
- `hasher`: a prompt's block hashes and keys (the one root rule: model digest + cache_salt);
- `held`: how many leading blocks of a prompt the cache holds: the pool's run, extended by
  loading the run after it from the tiers (`start_load` / `finish_load`: the same, with reads
  below host RAM off the step thread, kvabi/cache/tier_loader.py);
- `export` / `export_layer`: blocks as `CacheBuffers` with their hashes and tokens;
- `import_blocks`: verified blocks placed into the pool as cached blocks, so the next request
  with that prefix hits them;
- `lend` / `reserve`, `commit`, `cancel`: the same blocks without a copy, for a peer that READs
  them straight out of one pool into another (NIXL): the sender lends its pooled blocks
  (pinned until released), the receiver reserves free ones, has them written, then indexes them
  once verified (or frees them unindexed).
Blocks the pool evicts are written down the tiers inside allocation (`BlockPool.write_down`), so
no path that allocates can give a tier the wrong KV under an old hash. The scheduler (in
`kvabi/engine`) also uses the pool directly for its ref counts and block tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvabi.abi.buffers import CacheBuffers, layer_buffer_specs
from kvabi.abi.descriptor import CENTRIES, Descriptor
from kvabi.cache.block_api import (  # noqa: F401 - the block API's types, re-exported
    NO_MATCH,
    NULL_BLOCK,
    BlockReservation,
    FetchRequest,
    ImportResult,
    KVLoan,
    KVPayload,
    MatchResult,
    held_blocks,
)
from kvabi.cache.block_events import BlockEventSink, event_groups
from kvabi.cache.block_groups import plan_groups
from kvabi.cache.block_hasher import BlockHasher, BlockKey
from kvabi.cache.block_pool import BlockPool
from kvabi.cache.cache_stats import CacheStats, flat_stats
from kvabi.cache.group_blocks import (
    export_group_layer,
    export_groups,
    group_key,
    held_tiered,
    import_groups,
    match_groups,
)
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_loader import PendingLoad, TierLoader
from kvabi.cache.tiered_cache import TieredCache


@dataclass(frozen=True)
class _Extension:
    """Blocks `first .. last - 1` of a prompt that would extend the pool's run of it (`held`
    blocks, pool blocks `pooled`; none when `last <= held`); `hashes`: the prompt's."""

    hashes: list[bytes]
    held: int
    pooled: list[int]
    first: int
    last: int


class KVCache:
    def __init__(
        self,
        desc: Descriptor,
        num_blocks: int | Sequence[int],
        prefix_caching: bool = True,
        tiers: TierConfig = TierConfig(),
        events: BlockEventSink | None = None,
        make_storage: Callable[[Descriptor, int], KVStorage] = KVStorage,
    ) -> None:
        """`desc`: the storage's layout (a paged preset of the model); `num_blocks`: per block
        pool (one number: every pool); `events`: told of every change to the index of cached
        blocks (KV events for prefix-aware routers). Tiers hold cached blocks, so they need
        `prefix_caching` (EngineConfig checks).

        A hybrid model (sliding, shared or KV-less layers) gets several block groups over one
        pool per layer geometry (kvabi/cache/block_groups.py); its prefix match, held, export
        and import go per group (kvabi/cache/group_blocks.py), tier entries too (one
        `TieredCache` per pool over the same tiers).

        `make_storage(pool_desc, num_blocks)` builds each pool's storage (a TP group's rank 0:
        one holding its heads, whose whole blocks hold every rank's: kvabi/engine/tp_storage.py)."""
        self.desc, self.block_size = desc, desc.layout.block_size
        self.is_prefix_caching = prefix_caching
        self.plan = plan_groups(desc.model)
        self.groups = self.plan.groups
        counts = (
            [num_blocks] * len(self.plan.pool_specs) if isinstance(num_blocks, int) else num_blocks
        )
        self.storages = [
            make_storage(Descriptor(spec, desc.layout), n)
            for spec, n in zip(self.plan.pool_specs, counts, strict=True)
        ]
        self.storage = self.storages[0]
        self.hasher = BlockHasher(desc.model.compat_digest(), self.block_size)
        self.tiers = TieredCache.build(tiers, self.storage) if tiers.is_enabled else None
        self.pool_tiers = [self.tiers]  # per pool: the tiers below it, with its codec
        if self.tiers is not None:
            self.pool_tiers += [self.tiers.beside(s, tiers) for s in self.storages[1:]]
        self.events = events
        self.pools = [
            BlockPool(
                n,
                events,
                self._write_down_of(i) if self.tiers is not None else None,
                event_groups(self.plan),
            )
            for i, n in enumerate(counts)
        ]
        self.pool = self.pools[0]
        self.stats = CacheStats()
        below_ram = self.tiers is not None and any(not t.holds_blocks for t in self.tiers.tiers)
        # reads below host RAM off the step thread (one block group: the others load in place)
        self.loader = TierLoader(self) if below_ram and self.plan.is_uniform else None

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the first pool (every pool's, in a one-pool cache)."""
        return self.storage.buffers.num_bytes // self.pool.num_blocks

    def layer_storage(self, layer_id: int) -> tuple[KVStorage, int]:
        """The storage a layer's K/V live in (its group's pool) and its slot there; a shared
        layer gets its target's."""
        group_id, slot = self.plan.layer_slots[layer_id]
        return self.storages[self.groups[group_id].pool_id], slot

    def _require_one_group(self, what: str) -> None:
        if not self.plan.is_uniform:
            raise ValueError(f"{what}: a hybrid model's cache (block groups) cannot yet")

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
        is still returned: the caller copies it on write and recomputes only the last token.

        Per block group (vLLM's hybrid rule): full-attention groups need every block of the
        prefix; sliding groups only those the window before the hit point still covers."""
        if len(self.groups) == 1 and self.groups[0].window == 0:
            num_cached = min(self.num_pooled(hashes) * self.block_size, num_tokens - 1)
            if num_cached <= 0:
                return NO_MATCH
            n = -(-num_cached // self.block_size)
            return MatchResult(num_cached, (tuple(self.pool.cached_block(h) for h in hashes[:n]),))
        return match_groups(self, hashes, num_tokens)

    def cached_in(self, group_id: int, block_hash: bytes) -> int | None:
        """The block of `group_id`'s pool holding this hash for the group, if any."""
        return self.pools[self.groups[group_id].pool_id].cached_block(block_hash, group_id)

    def cache_blocks(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int],
        start: int, stop: int, group_id: int = 0,
    ) -> None:  # fmt: skip
        """Index a sequence's blocks `start .. stop-1` (full and computed) of one group under
        their keys (a sliding group's released blocks, `NULL_BLOCK`, are skipped)."""
        keys = self.hasher.keys_of(hashes, token_ids, start, stop)
        pool = self.pools[self.groups[group_id].pool_id]
        for block_id, key in zip(block_ids[start:stop], keys, strict=True):
            if block_id != NULL_BLOCK:  # released by a sliding window
                pool.cache_block(block_id, key, group_id)

    def demote(self, hashes: Sequence[bytes]) -> None:
        """An idle session's blocks (head first, every group's): write down the pooled ones
        some tier lacks and put them all first in their pool's eviction order."""
        for pool_id, pool in enumerate(self.pools):
            block_ids = [
                b
                for h in hashes
                for g in self.groups
                if g.pool_id == pool_id and (b := self.cached_in(g.group_id, h)) is not None
            ]
            tiers = self.pool_tiers[pool_id] if self.tiers is not None else None
            if tiers is not None:
                keys = [self._tier_key(pool.keys[i], pool.groups[i]) for i in block_ids]
                todo = tiers.lacking(keys)
                if todo:
                    tiers.write_down([block_ids[j] for j in todo], [keys[j] for j in todo])
            pool.demote(block_ids)

    # ---- the block API ----

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` the pool holds, after loading the run that follows
        its pooled prefix from the tiers (verified; loaded blocks are cached, unreferenced)."""
        if not self.plan.is_uniform:
            return held_tiered(self, keys)
        n = self.num_pooled([k.block_hash for k in keys])
        if self.tiers is None or n == len(keys):
            return n
        pooled = self.pooled_ids([k.block_hash for k in keys[:n]])
        room = self.pool.num_free - self.pool.num_free_of(pooled)
        targets: list[int] = []  # placed blocks stay held until the last run is placed
        self.pool.touch(pooled)
        try:
            loaded = self.tiers.load(
                keys[n:], max(room, 0), lambda c, ids, run: self._write_new(c, ids, run, targets)
            )
        finally:
            self.pool.free(pooled + targets)
        return n + loaded

    def start_load(self, keys: Sequence[BlockKey]) -> PendingLoad | None:
        """`held`, with reads below host RAM on the loader's thread: returns the pending load
        to `finish_load` once it `is_done` (None: whatever the tiers hold was loaded now)."""
        if self.loader is None:
            self.held(keys)
            return None
        return self.loader.start(keys)

    def finish_load(self, load: PendingLoad) -> int:
        """Place a done load's blocks that still extend the pooled prefix; how many."""
        return self.loader.place(load)

    def export(
        self, token_ids: Sequence[int], cache_salt: str | None, start_token: int = 0
    ) -> KVPayload:
        """A copy of the prompt's pooled blocks from `start_token` (a block boundary) up to
        the first one the pool lacks, in this cache's layout."""
        if not self.plan.is_uniform:
            self._check_local("a hybrid cache's export")
            return export_groups(self, token_ids, cache_salt, start_token)
        hashes = self.hasher.hashes(token_ids, cache_salt)
        first = start_token // self.block_size
        num_blocks = max(self.num_pooled(hashes) - first, 0)
        block_ids = self.pooled_ids(hashes[first : first + num_blocks])
        cache = self.storage.read_blocks(block_ids)  # [num_blocks] blocks, own layout
        tokens = tuple(token_ids[start_token : (first + num_blocks) * self.block_size])
        return KVPayload(start_token, tokens, tuple(hashes[first : first + num_blocks]), cache)

    def export_layer(
        self, layer_id: int, block_tables: Sequence[Sequence[int]], blocks: slice
    ) -> dict[str, Tensor]:
        """A copy of one owner layer of a sequence's blocks `blocks` (its block tables, one per
        group), in this cache's layout: that layer's section of a container of them, before
        any window tail is cut (called mid-forward, once the layer's K/V are stored). A
        sliding layer's blocks before its window at `blocks.stop` are zeros."""
        self._check_local("a layer's export")
        if not self.plan.is_uniform:
            return export_group_layer(self, layer_id, block_tables, blocks)
        index = torch.tensor(block_tables[0][blocks], dtype=torch.long)
        tensors = self.storage.buffers.tensors
        return {
            spec.key: tensors[spec.key].index_select(spec.dim("B"), index)
            for spec in layer_buffer_specs(self.desc, layer_id, len(index))
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
        if not self.plan.is_uniform:
            return import_groups(self, token_ids, cache_salt, payload)
        bs = self.block_size
        x = self._extension(token_ids, cache_salt, payload.start_token, payload.end_token // bs)
        if x.last <= x.held:
            return ImportResult(x.held * bs, 0)
        keys = self.hasher.keys_of(x.hashes, token_ids, x.first, x.last)
        return ImportResult(x.last * bs, self.place(x.pooled, keys, payload.cache))

    def _extension(
        self, token_ids: Sequence[int], cache_salt: str | None, start_token: int, stop: int
    ) -> _Extension:
        """The prompt's blocks from `start_token` (a block boundary) up to block `stop` that
        would extend the pool's run of it and fit in its free blocks."""
        bs, hashes = self.block_size, self.hasher.hashes(token_ids, cache_salt)
        held, first = self.num_pooled(hashes), start_token // bs
        pooled = self.pooled_ids(hashes[:held])
        room = self.pool.num_free - self.pool.num_free_of(pooled)
        last = min(stop, len(hashes), first + room)
        if start_token % bs or held < first:  # a gap before `start_token`: nothing extends it
            last = held
        return _Extension(hashes, held, pooled, first, last)

    # ---- blocks read straight from pool to pool (a uniform cache whose storage is local) ----

    @property
    def lends_blocks(self) -> bool:
        """Whether `lend` and `reserve` work here (one block group, whole blocks local)."""
        return self.plan.is_uniform and self._is_local and self.is_prefix_caching

    @property
    def lent_buffers(self) -> CacheBuffers | None:
        """The buffers whose blocks `lend` lends and `reserve` reserves (None: it cannot)."""
        return self.storage.buffers if self.lends_blocks else None

    def lend(self, token_ids: Sequence[int], cache_salt: str | None, start_token: int) -> KVLoan:
        """The prompt's pooled blocks from `start_token` (a block boundary) up to the first one
        the pool lacks, pinned until the loan's `release()` (call it on this cache's thread)."""
        self._require_lending("a loan")
        hashes = self.hasher.hashes(token_ids, cache_salt)
        first = start_token // self.block_size
        hashes = hashes[first : max(self.num_pooled(hashes), first)]
        block_ids = self.pooled_ids(hashes)
        self.pool.touch(block_ids)
        tokens = tuple(token_ids[start_token : start_token + len(hashes) * self.block_size])
        buffers, ids = self.storage.buffers, tuple(block_ids)
        return KVLoan(start_token, tokens, tuple(hashes), buffers, ids, lambda: self.pool.free(ids))

    def reserve(
        self, token_ids: Sequence[int], cache_salt: str | None, start_token: int, num_blocks: int
    ) -> BlockReservation | None:
        """Free blocks for the prompt's `num_blocks` blocks from `start_token` (as many as fit
        and exist), or None when they would not extend the pooled prefix."""
        self._require_lending("a reservation")
        stop = start_token // self.block_size + num_blocks
        x = self._extension(token_ids, cache_salt, start_token, stop)
        if x.last <= x.held:
            return None
        self.pool.touch(x.pooled)
        keys = tuple(self.hasher.keys_of(x.hashes, token_ids, x.first, x.last))
        block_ids = tuple(sorted(self.pool.allocate(x.last - x.first)))  # ascending: long runs
        pooled, hashes = tuple(x.pooled), tuple(x.hashes[: x.last])
        return BlockReservation(start_token, block_ids, keys, pooled, hashes, self.storage.buffers)

    def commit(self, reservation: BlockReservation, num_blocks: int) -> ImportResult:
        """Index the reservation's first `num_blocks` blocks (written and verified) and free
        every block it held; blocks the pool meanwhile got elsewhere stay unindexed."""
        r = reservation
        try:
            pairs = zip(r.block_ids[:num_blocks], r.keys[:num_blocks], strict=True)
            num_placed = sum(self.pool.cache_block(b, k) for b, k in pairs)
        finally:
            self.cancel(r)
        return ImportResult(self.num_pooled(r.hashes) * self.block_size, num_placed)

    def cancel(self, reservation: BlockReservation) -> None:
        """Free every block the reservation held (its own ones unindexed, as they were)."""
        self.pool.free([*reservation.pooled, *reservation.block_ids])

    def _require_lending(self, what: str) -> None:
        if not self.lends_blocks:
            raise ValueError(f"{what}: needs one block group, local storage and a prefix cache")

    # ---- housekeeping ----

    def drop_cached(self) -> int:
        """Forget every pool's free cached blocks; return how many. When that empties every
        pool's index, followers of the events hear one `cleared`; else each block's removal
        (a pool emptied beside one that still holds blocks is not the cache cleared)."""
        is_all = all(p.is_all_free_cached for p in self.pools)
        num_dropped = sum(p.drop_cached(is_reported=not is_all) for p in self.pools)
        if is_all and self.events is not None:
            self.events.cleared()
        return num_dropped

    def flat_stats(self) -> dict[str, float]:
        """Prefix cache and tier metrics as flat `name -> value` (kvabi/cache/cache_stats.py)."""
        tiers = self.tiers.tiers if self.tiers else []
        writer = self.tiers.writer if self.tiers else None
        return flat_stats(self.stats, self.pool, self.block_bytes, tiers, writer)

    def flush(self) -> None:
        """Wait until every queued write-down has reached the lower tiers."""
        for tiers in self.pool_tiers if self.tiers is not None else ():
            tiers.flush()

    def close(self) -> None:
        """Finish queued write-downs and release the tiers (their connections and thread)."""
        if self.loader is not None:
            self.loader.close()
        for tiers in reversed(self.pool_tiers) if self.tiers is not None else ():
            tiers.close()  # the first pool's, which owns the tiers, last

    @property
    def has_compressed(self) -> bool:
        """Whether it holds compressed entries (DeepSeek V4: centries layers)."""
        return any(x.kind == CENTRIES for x in self.desc.model.layers)

    @property
    def _is_local(self) -> bool:
        """Whether the tensors hold whole blocks (not one TP rank's heads of them)."""
        return all(s.entry_desc is s.desc for s in self.storages)

    def _check_local(self, what: str) -> None:
        """Refuse a path that reads the tensors directly where they hold part of each block."""
        if not self._is_local:
            raise ValueError(f"{what} reads one rank's heads; under TP it is not supported")

    def _tier_key(self, key: BlockKey, group_id: int) -> BlockKey:
        """A block's key in the tiers: its own, or, in a hybrid cache, its group's."""
        return key if self.plan.is_uniform else group_key(key, group_id)

    def _write_down_of(self, pool_id: int) -> Callable[[list[int], list[BlockKey]], None]:
        """Pool `pool_id`'s hook for the blocks it evicts: down its tiers, keyed per group."""

        def write_down(block_ids: list[int], keys: list[BlockKey]) -> None:
            groups = self.pools[pool_id].groups  # an evicted block keeps its group here
            tier_keys = [self._tier_key(k, groups[b]) for b, k in zip(block_ids, keys, strict=True)]
            self.pool_tiers[pool_id].write_down(block_ids, tier_keys)

        return write_down

    def pooled_ids(self, hashes: Sequence[bytes]) -> list[int]:
        """The pool blocks still holding any of these hashes, in the given order."""
        found = (self.pool.cached_block(h) for h in hashes)
        return [b for b in found if b is not None]

    def place(self, pooled: list[int], keys: list[BlockKey], cache: CacheBuffers) -> int:
        """Write `cache`'s first `len(keys)` blocks into new pool blocks indexed under `keys`,
        the prefix blocks `pooled` pinned meanwhile (so allocating cannot evict them); returns
        how many were new. All end up free: cached, or empty when the pool already held that
        hash."""
        self.pool.touch(pooled)
        targets: list[int] = []
        try:
            return self._write_new(cache, None, keys, targets)
        finally:
            self.pool.free(pooled + targets)

    def _write_new(
        self, cache: CacheBuffers, src_ids: list[int] | None, keys: list[BlockKey],
        targets: list[int],
    ) -> int:  # fmt: skip
        """Write `cache`'s blocks `src_ids` (None: its first `len(keys)`) into new pool blocks,
        added to `targets` (held until the caller frees them), indexed under `keys`; returns
        how many were new."""
        new = self.pool.allocate(len(keys))  # evicted blocks are written down inside
        targets += new
        self.storage.write_blocks(cache, new, src_ids)  # converts layout and block size
        return sum(self.pool.cache_block(b, k) for b, k in zip(new, keys, strict=True))
