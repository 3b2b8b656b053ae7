"""`TieredCache`: the tiers below the pool. Blocks go down when they leave it; hits come back.

- Down: a cached block the pool evicts (its memory taken for another block), or an idle
  session's block, is copied out of the KV storage on the step thread (`write_down`: one gather
  for all of an allocation's, before anything can overwrite them) and handed to the
  `TierWriter`, which stores it in every tier that lacks it (tiers are inclusive): into the
  host tier's slab as it is, encoded as a container for the others.
- Up: `load` finds the leading run of blocks some tier holds, in tier order (host, disk,
  Redis; the first that has a block serves it), and verifies each entry (checksums, model,
  block identity) before it is handed on; one that fails is removed from its tier and the run
  stops there: the rest of the prompt is recomputed, never read from a bad entry. `KVCache`
  places the runs straight into the pool (from the host tier's slab: one gather per buffer);
  `fetch` returns a copy (the vLLM connector places it into vLLM's blocks).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.errors import IncompatibleError
from kvabi.cache.block_codec import BlockCodec, stack_blocks
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.tier import KVTier
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_writer import TierWriter
from kvabi.wire.entries import EntryShape, RowSums, entry_shape, rows_cache, verify_rows
from kvabi.wire.row_arena import ROWS

log = logging.getLogger("kvabi.cache")
Plan = list[tuple[KVTier, BlockKey]]
# (a cache holding a run's blocks, which of its blocks (None: all, in order), the run's keys)
Place = Callable[[CacheBuffers, list[int] | None, list[BlockKey]], None]


class TieredCache:
    def __init__(
        self,
        desc: Descriptor,
        tiers: list[KVTier],
        config: TierConfig = TierConfig(),
        storage: KVStorage | None = None,
    ) -> None:
        """Entries hold blocks of `desc`; `storage`: the KV storage `write_down` copies blocks
        out of (None for a reader that only fetches, such as the vLLM connector)."""
        self.tiers, self.storage = tiers, storage
        self.desc, self.block_size = desc, desc.layout.block_size
        self.codec = BlockCodec(desc)
        self.writer = None  # what write_down hands its copies to (with a storage)
        self.owns_tiers = True  # close() releases the tiers (not for one made `beside`)
        if storage is not None:
            self.writer = TierWriter(tiers, self.codec, config.write_queue_bytes)

    @classmethod
    def build(cls, config: TierConfig, storage: KVStorage) -> TieredCache:
        """The configured tiers below this storage."""
        tiers = config.build(storage.entry_desc.model.compat_digest())
        return cls(storage.entry_desc, tiers, config, storage)

    def beside(self, storage: KVStorage, config: TierConfig) -> TieredCache:
        """The same tiers below another storage (another block pool of a hybrid cache): its
        own codec and writer, the tiers' room and connections shared; close it first."""
        other = TieredCache(storage.entry_desc, self.tiers, config, storage)
        other.owns_tiers = False
        return other

    def tier(self, name: str) -> KVTier:
        """The tier of this name (`host`, `disk`, `redis`)."""
        return next(t for t in self.tiers if t.name == name)

    def write_down(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        """Queue a copy of these blocks for the tiers (room is reserved before anything is
        copied; what does not fit is dropped and counted)."""
        block_bytes = self.storage.entry_block_bytes
        n = self.writer.reserve(len(block_ids), block_bytes)
        if n:
            snapshot = self.storage.read_blocks(block_ids[:n])
            self.writer.submit(snapshot, keys[:n], n * block_bytes)

    def lacking(self, keys: Sequence[BlockKey]) -> list[int]:
        """The indices of the keys some tier lacks."""
        held = [t.contains_many([k.block_hash for k in keys]) for t in self.tiers]
        return [j for j in range(len(keys)) if not all(h[j] for h in held)]

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some tier holds its block (presence only: nothing is read)."""
        present = self._present([k.block_hash for k in keys]) if self.tiers else []
        return [any(j in p for p in present) for j in range(len(keys))]

    def load(self, keys: Sequence[BlockKey], max_blocks: int | None, place: Place) -> int:
        """Hand the verified blocks of the leading run of `keys` some tier holds (at most
        `max_blocks`), each from the first tier holding it, to `place` in order, a run at a
        time: `place(cache, block_ids, run_keys)`, the run's blocks being `cache`'s blocks
        `block_ids` (a host slab's slots, called while they are locked) or all of it (None,
        entries decoded). Returns how many blocks were handed over."""
        loaded = 0
        for tier, entries in itertools.groupby(self._plan(keys)[:max_blocks], key=lambda e: e[0]):
            run = [key for _, key in entries]  # consecutive blocks the same tier serves
            n = self._load_run(tier, run, place)
            loaded += n
            if n < len(run):
                break
        return loaded

    def in_memory(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` the tiers in this process's memory hold (the host
        tier: read at memory speed; a presence check only)."""
        n = 0
        for tier in self.tiers:
            if not tier.holds_blocks:
                break
            for held in tier.contains_many([k.block_hash for k in keys[n:]]):
                if not held:
                    break
                n += 1
        return n

    def fetch(self, keys: Sequence[BlockKey], max_blocks: int | None = None) -> CacheBuffers | None:
        """A copy of the verified blocks of the leading run of `keys` some tier holds (see
        `load`), in this cache's entry layout, blocks 0, 1, ...; None when there are none."""
        parts: list[CacheBuffers] = []

        def take(cache: CacheBuffers, block_ids: list[int] | None, run: list[BlockKey]) -> None:
            if block_ids is not None or cache.desc != self.desc:
                cache = convert(
                    cache, self.desc, num_tokens=len(run) * self.block_size,
                    src_block_ids=block_ids,
                )  # fmt: skip
            parts.append(cache)

        self.load(keys, max_blocks, take)
        return stack_blocks(parts) if len(parts) > 1 else (parts[0] if parts else None)

    def flush(self) -> None:
        """Wait for queued write-downs (tests, benches, a second process about to read)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Write what is queued, stop the writer, release the tiers' connections."""
        if self.writer is not None:
            self.writer.close()
        for tier in self.tiers if self.owns_tiers else ():
            tier.close()

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
                tier.stats.add(queries=1, query_tokens=n * len(keys[0].token_ids))
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

    def _load_run(self, tier: KVTier, run: list[BlockKey], place: Place) -> int:
        """Hand the verified leading blocks of `run`, all from `tier`, to `place` (one round
        trip); how many."""
        start = time.perf_counter()
        n = tier.load_blocks(run, self.desc.model, place) if tier.holds_blocks else 0
        if n < len(run):
            n += self._load_entries(tier, run[n:], place)
        tokens = sum(len(k.token_ids) for k in run[:n])
        tier.stats.add(loads=1, load_seconds=time.perf_counter() - start, hit_tokens=tokens)
        return n

    def _load_entries(self, tier: KVTier, run: list[BlockKey], place: Place) -> int:
        """Read `run`'s entries from `tier` into one array (one round trip), verify the leading
        ones in bulk and hand them to `place`. From an entry the bulk reader stops at, the rest
        are read again as bytes (a second round trip): that one decoded on its own, refused
        with its reason or converted, the ones after it in bulk again. How many were placed."""
        hashes, i = [k.block_hash for k in run], 0
        shape = entry_shape(self.desc)
        if shape is not None:  # read into one array, verified there: the blocks are views of it
            i, rows = self._read_verified(tier, run, shape)
            if i:
                place(rows_cache(shape, rows[:i]), None, run[:i])
            if i == len(run):
                return i
        entries = [None] * i + tier.get_many(hashes[i:])
        while i < len(run):
            n, cache = self.codec.decode_many(entries[i:], run[i:])
            if not n:
                cache = self._decode(tier, run[i], entries[i])
                if cache is None:
                    break
                n = 1
                cache = cache if cache.desc == self.desc else convert(cache, self.desc)
            place(cache, None, run[i : i + n])
            i += n
        return i

    def _read_verified(
        self, tier: KVTier, run: list[BlockKey], shape: EntryShape
    ) -> tuple[int, np.ndarray]:
        """Read `run`'s entries into the rows of one array and verify them all at once; how
        many leading ones are verified, and the array."""
        rows = ROWS.rows(len(run), shape.size)  # reused memory: no page faults
        hashes, sums = [k.block_hash for k in run], RowSums(shape.sum_spans)
        k = tier.read_rows(hashes, rows, sums)  # the disk tier sums each file as it reads it
        ids = [key.token_ids for key in run]
        return verify_rows(shape, rows[:k], ids, hashes, sums.out), rows

    def _decode(self, tier: KVTier, key: BlockKey, entry: bytes | None) -> CacheBuffers | None:
        if entry is None:
            return None
        try:
            return self.codec.decode(entry, key)
        except IncompatibleError as exc:
            tier.stats.add(refused=1)
            reason: Exception = exc
        except Exception as exc:  # KvabiError, or bytes no reader expects: never loaded either way
            tier.stats.add(corrupt=1)
            reason = exc
        log.warning("kvabi: %s entry %s refused: %s", tier.name, key.block_hash.hex(), reason)
        tier.remove(key.block_hash)
        return None
