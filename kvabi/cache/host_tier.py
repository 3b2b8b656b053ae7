"""`HostTier`: entries in host RAM, an LRU bounded in bytes.

The engine's blocks are kept as tensors, not containers: a slab per entry layout (a block pool
in host RAM, in the layout `KVStorage.read_blocks` gives), whose slots hold one block each. A
write-down is one copy per buffer into free slots (`put_blocks`), a load one gather per buffer
out of them straight into the engine's pool (`load_blocks`): no encoding, no checksum pass, no
Python per block. Entries never leave the process, so there is nothing to verify but that each
is the block asked for (its tokens) of the reader's model. Writers that hand bytes (a one-block
container, as for the other tiers) are stored as bytes, and read back through `get_many`.

A slab is as large as the capacity allows for its block size (allocated, not touched: pages
become resident as slots are written); the capacity in bytes is shared by every slab.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.tier import KVTier

log = logging.getLogger("kvabi.cache")

# called with the lock held: (a slab's buffers, the slots of the run's blocks, the run's keys)
PlaceRun = Callable[[CacheBuffers, list[int], list[BlockKey]], None]


class _Slab:
    """Slots for blocks of one descriptor (paged, the writer's layout)."""

    def __init__(self, desc: Descriptor, capacity_bytes: int) -> None:
        self.desc = desc
        self.block_bytes = CacheBuffers.empty(desc, 1).num_bytes
        num_slots = max(capacity_bytes // self.block_bytes, 1)
        self.buffers = CacheBuffers.empty(desc, num_slots)
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_slots(self) -> int:
        return self.buffers.extent


@dataclass(frozen=True)
class _Held:
    """A block in a slab slot, with the tokens it was written under."""

    slab: _Slab
    slot: int
    token_ids: tuple[int, ...]


class HostTier(KVTier):
    name = "host"
    holds_blocks = True

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._entries: OrderedDict[bytes, bytes | _Held] = OrderedDict()  # least recent first
        self._slabs: dict[Descriptor, _Slab] = {}
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def put_blocks(self, blocks: CacheBuffers, keys: Sequence[BlockKey]) -> None:
        """Keep blocks 0 .. len(keys)-1 of `blocks` (paged) under their keys, those not held
        yet, as an LRU taking them in order would (the last ones, when they are more than the
        capacity holds); the ones held already become most recent."""
        if keys:
            self._guard(lambda: self._put_blocks(blocks, keys), None)

    def load_blocks(self, keys: Sequence[BlockKey], model: ModelSpec, place: PlaceRun) -> int:
        """How many leading blocks of `keys` were handed to `place`, a run per slab, while
        the lock keeps their slots from being reused; a block held under other tokens or of
        another model than `model` is removed and ends the run."""
        return self._guard(lambda: self._load_blocks(keys, model, place), 0) if keys else 0

    def _put_blocks(self, blocks: CacheBuffers, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            slab = self._slab(blocks.desc)
            new = []
            for i, key in enumerate(keys):
                if key.block_hash in self._entries:
                    self._entries.move_to_end(key.block_hash)
                else:
                    new.append(i)
            # more new blocks than slots: the LRU would take the first ones in and out again
            passed = max(len(new) - slab.num_slots, 0)
            src, dst, evicted = new[passed:], [], passed
            for i in src:
                evicted += self._make_room(slab.block_bytes, slab)
                slot = slab.free.pop()
                self._entries[keys[i].block_hash] = _Held(slab, slot, keys[i].token_ids)
                self._num_bytes += slab.block_bytes
                dst.append(slot)
            if dst:
                num_tokens = len(dst) * blocks.desc.layout.block_size
                convert(
                    blocks, slab.desc, num_tokens=num_tokens,
                    src_block_ids=src, dst_block_ids=dst, out=slab.buffers,
                )  # fmt: skip
        self.stats.add(writes=len(new), write_bytes=len(new) * slab.block_bytes, evictions=evicted)

    def _slab(self, desc: Descriptor) -> _Slab:
        if not desc.layout.is_paged:
            raise ValueError("host tier: blocks come from a paged descriptor")
        slab = self._slabs.get(desc)
        if slab is None:
            slab = self._slabs[desc] = _Slab(desc, self.capacity_bytes)
        return slab

    def _load_blocks(self, keys: Sequence[BlockKey], model: ModelSpec, place: PlaceRun) -> int:
        bad: tuple[BlockKey, str] | None = None
        with self._lock:
            runs: list[tuple[_Slab, list[int], list[BlockKey]]] = []
            for key in keys:
                held = self._entries.get(key.block_hash)
                if not isinstance(held, _Held):
                    break  # absent, or bytes (read through get_many)
                is_new_slab = not runs or runs[-1][0] is not held.slab
                if held.token_ids != key.token_ids:
                    bad = key, "other tokens"
                elif is_new_slab and held.slab.desc.model != model:
                    bad = key, "another model's block"
                if bad is not None:
                    self._drop(key.block_hash)
                    break
                self._entries.move_to_end(key.block_hash)
                if is_new_slab:
                    runs.append((held.slab, [], []))
                runs[-1][1].append(held.slot)
                runs[-1][2].append(key)
            for slab, slots, run in runs:
                place(slab.buffers, slots, run)
        if bad is not None:
            self.stats.add(corrupt=1)
            key, what = bad
            log.warning("kvabi: host entry %s refused: it holds %s", key.block_hash.hex(), what)
        return sum(len(run) for _, _, run in runs)

    def _make_room(self, num_bytes: int, slab: _Slab | None) -> int:
        """Evict least recent entries until `num_bytes` more fit (and `slab` has a free
        slot); return how many went. Lock held."""
        evicted = 0
        while self._entries and (
            self._num_bytes + num_bytes > self.capacity_bytes or (slab and not slab.free)
        ):
            block_hash = next(iter(self._entries))
            self._drop(block_hash)
            evicted += 1
        return evicted

    def _drop(self, block_hash: bytes) -> None:
        """Forget an entry, freeing its bytes (and slot). Lock held."""
        entry = self._entries.pop(block_hash)
        if isinstance(entry, _Held):
            entry.slab.free.append(entry.slot)
            self._num_bytes -= entry.slab.block_bytes
        else:
            self._num_bytes -= len(entry)

    def _contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [h in self._entries for h in block_hashes]

    def _get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Bytes entries; a block kept as tensors reads as None here (`load_blocks` reads it)."""
        out: list[bytes | None] = []
        with self._lock:
            for h in block_hashes:
                entry = self._entries.get(h)
                if isinstance(entry, bytes):
                    self._entries.move_to_end(h)
                    out.append(entry)
                else:
                    out.append(None)
        return out

    def _put(self, block_hash: bytes, entry: bytes | memoryview) -> None:
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return
            entry = bytes(entry)  # held: its own bytes, not a view pinning other entries
            evicted = self._make_room(len(entry), None)
            self._entries[block_hash] = entry
            self._num_bytes += len(entry)
        self.stats.add(writes=1, write_bytes=len(entry), evictions=evicted)

    def _remove(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._entries:
                self._drop(block_hash)

    def lru_order(self) -> list[bytes]:
        """Hashes from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._entries)
