"""`BlockPool`: fixed-size KV blocks by id, with ref counts, an O(1) free queue that doubles as
the eviction order, and the prefix cache's index of full blocks by block hash (vLLM v1's design).

Pure bookkeeping over ids; the tensors live in `KVStorage`. A block is free when its ref count is
0. A free block is either *empty* (no hash: nothing worth keeping) or *cached* (a full block
indexed by its hash, reusable by any request whose prompt has that block).

Eviction order, which `allocate` follows and the tests pin:
1. empty blocks, least recently freed first;
2. cached blocks, least recently used first. A sequence's blocks are freed tail first, so within
   a chain the tail goes before its head (a tail is reachable only through its head). `demote`
   moves blocks to the front of this queue (an idle session's blocks go first).
Taking a cached block out of the queue to reuse its memory evicts it: its hash leaves the index
and, given a `write_down` hook, `allocate` hands the evicted blocks to it before it returns, so
their data goes down a tier before any caller can overwrite it (no caller can skip that).

Given a `BlockEventSink` (`events`), the pool tells it of every change to its index: a block
registered under its hash (with its parent hash and tokens), a cached block evicted or dropped
(kvabi/cache/block_events.py; KV events for prefix-aware routers). That the whole index is
empty (`cleared`) only the cache can tell, which sees every pool (`KVCache.drop_cached`).

Block groups of a hybrid model (kvabi/cache/block_groups.py) share a pool: the index is keyed by
(group, block hash), since each group caches its own copy of a block's layers. Each event names
its block's group as `event_groups[group]` has it (a sliding group's evictions are its own, not
the full group's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvabi.cache.block_events import UNIFORM, BlockEventSink, EventGroup
from kvabi.cache.block_hasher import BlockKey

WriteDown = Callable[[list[int], list[BlockKey]], None]  # evicted block ids, their keys


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (callers check first)."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        events: BlockEventSink | None = None,
        write_down: WriteDown | None = None,
        event_groups: Sequence[EventGroup] = (UNIFORM,),
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.events = events  # told of each change to the index
        self.event_groups = tuple(event_groups)  # per group id: how its events name it
        self.write_down = write_down  # given each allocation's evicted blocks, in order
        self.ref_counts = [0] * num_blocks
        self.keys: list[BlockKey | None] = [None] * num_blocks  # set while a block is cached
        self.groups = [0] * num_blocks  # the group a cached block is indexed for
        self.num_evictions = 0
        self._by_hash: dict[tuple[int, bytes], int] = {}
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free cached blocks, LRU first

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks indexed by hash, held or free."""
        return len(self._by_hash)

    @property
    def num_free_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each) in eviction order; cached ones are evicted."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        ids, evicted = [], []
        for _ in range(n):
            queue = self._empty if self._empty else self._cached
            block_id, _ = queue.popitem(last=False)
            key = self._evict(block_id)
            if key is not None:
                evicted.append((block_id, key))
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        if evicted and self.write_down is not None:  # their data is intact until we return
            self.write_down([i for i, _ in evicted], [k for _, k in evicted])
        return ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each held block (a forked sequence reads the same blocks)."""
        for i in block_ids:
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} is free; only held blocks can be shared")
            self.ref_counts[i] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each cached block, taking free ones out of the queue (a hit)."""
        for i in block_ids:
            if self.keys[i] is None:
                raise ValueError(f"block {i} is not cached; only cached blocks can be touched")
            if self.ref_counts[i] == 0:
                del self._cached[i]
            self.ref_counts[i] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; blocks reaching 0 join the free queue."""
        for i in reversed(block_ids):
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                (self._empty if self.keys[i] is None else self._cached)[i] = None

    def num_free_of(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are free (a hit on them takes them out of the free queue)."""
        return sum(1 for i in block_ids if self.ref_counts[i] == 0)

    def is_writable(self, block_id: int) -> bool:
        """Whether a sequence holding this block may write into it: sole owner, not cached."""
        return self.ref_counts[block_id] == 1 and self.keys[block_id] is None

    def cache_block(self, block_id: int, key: BlockKey, group: int = 0) -> bool:
        """Index a held, full block of `group` by its hash; False (not indexed) when another
        block already holds that hash for the group or this block is already indexed."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free; only held blocks can be cached")
        if (group, key.block_hash) in self._by_hash or self.keys[block_id] is not None:
            return False
        self.keys[block_id], self.groups[block_id] = key, group
        self._by_hash[group, key.block_hash] = block_id
        if self.events is not None:
            self.events.stored(
                self.event_groups[group], key.block_hash, key.parent_hash, key.token_ids
            )
        return True

    def cached_block(self, block_hash: bytes, group: int = 0) -> int | None:
        """The block holding this hash for `group`, if any."""
        return self._by_hash.get((group, block_hash))

    def demote(self, block_ids: Iterable[int]) -> None:
        """Move free cached blocks to the front of the eviction order, keeping their given order
        (pass a chain head first: its tail ends up first to go)."""
        for i in block_ids:
            if i in self._cached:
                self._cached.move_to_end(i, last=False)

    @property
    def is_all_free_cached(self) -> bool:
        """Whether `drop_cached` would empty the index (no held block is indexed)."""
        return len(self._cached) == len(self._by_hash)

    def drop_cached(self, is_reported: bool = True) -> int:
        """Forget every free cached block (they become empty); return how many. Each one's
        removal is reported unless `is_reported` is False (the caller reports `cleared`)."""
        dropped = list(self._cached)
        self._cached.clear()
        for i in dropped:
            block_hash = self.keys[i].block_hash
            del self._by_hash[self.groups[i], block_hash]
            self.keys[i] = None
            self._empty[i] = None
            if self.events is not None and is_reported:
                self.events.removed(self.event_groups[self.groups[i]], block_hash)
        return len(dropped)

    def _evict(self, block_id: int) -> BlockKey | None:
        """Take a cached block's hash out of the index; return its key (None: it was empty)."""
        key = self.keys[block_id]
        if key is None:
            return None
        del self._by_hash[self.groups[block_id], key.block_hash]
        self.keys[block_id] = None
        self.num_evictions += 1
        if self.events is not None:
            self.events.removed(self.event_groups[self.groups[block_id]], key.block_hash)
        return key
