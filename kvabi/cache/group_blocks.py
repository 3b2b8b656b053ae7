"""The block API of a hybrid cache (several block groups): prefix match, held, export, import.

A uniform cache's blocks are all-or-nothing: block i of a prompt is pooled or not. A hybrid
cache holds block i per block group (kvabi/cache/block_groups.py), and what a prefix of h blocks
needs differs by group (vLLM's hybrid rule, docs/ABI.md 2.5): a full-attention group every block
0 .. h-1, a sliding group of window W only the blocks from `window_start(W, h * block_size)` on.
So a prefix is held when every group holds what it needs for it (`held_run`); an export sends,
per group, only those blocks (the others are zeros in the payload's buffers, and a container
carries sliding layers' tails only); an import places, per group, the blocks the pool lacks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvabi.abi.buffers import CacheBuffers, layer_buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.kv_groups import window_start
from kvabi.cache.block_api import NO_MATCH, NULL_BLOCK, ImportResult, KVPayload, MatchResult
from kvabi.cache.block_groups import BlockGroup
from kvabi.cache.block_hasher import BlockKey

if TYPE_CHECKING:
    from kvabi.cache.kv_cache import KVCache


def group_key(key: BlockKey, group_id: int) -> BlockKey:
    """A block's key in the tiers for one group: each group stores its own layers of the block,
    so its entry is keyed by the block hash and the group (SHA-256 of a tag, the group id and
    the hash); a tier entry can then not be read back as another group's layers."""
    tagged = hashlib.sha256(b"kvabi-block-group" + struct.pack("<I", group_id) + key.block_hash)
    return replace(key, block_hash=tagged.digest())


def needed(cache: KVCache, group: BlockGroup, start: int, end: int) -> range:
    """The blocks among `start .. end-1` a group needs for a prefix of `end` blocks."""
    first = window_start(group.window, end * cache.block_size) // cache.block_size
    return range(max(start, first), end)


def _has(cache: KVCache, group: BlockGroup, hashes: Sequence[bytes], blocks: range) -> bool:
    return all(cache.cached_in(group.group_id, hashes[i]) is not None for i in blocks)


def held_run(cache: KVCache, hashes: Sequence[bytes], start: int = 0) -> int:
    """The longest prefix (in blocks, at least `start`) for which every group holds the
    blocks from `start` on that it needs; those before `start` the caller vouches for."""
    n = len(hashes)
    for g in cache.groups:
        if g.window == 0:  # full attention: the leading run
            n = next(
                (i for i in range(start, n) if cache.cached_in(g.group_id, hashes[i]) is None), n
            )
    sliding = [g for g in cache.groups if g.window]
    for h in range(n, start, -1):
        if all(_has(cache, g, hashes, needed(cache, g, start, h)) for g in sliding):
            return h
    return start


def match_groups(cache: KVCache, hashes: Sequence[bytes], num_tokens: int) -> MatchResult:
    """`KVCache.match` for several block groups: the longest held prefix, capped at
    `num_tokens - 1` tokens, with per group its blocks (`NULL_BLOCK` where the window at the
    hit point no longer reaches). A cache of compressed entries (DeepSeek V4) hits whole
    blocks only: a compressor goes on from a block's end, its state record, never from inside
    one (kvabi/engine/compressed_paged.py)."""
    bs = cache.block_size
    for h in range(held_run(cache, hashes), 0, -1):
        num_cached = min(h * bs, num_tokens - 1)
        if cache.has_compressed:
            num_cached -= num_cached % bs
        if num_cached <= 0:
            break
        end = -(-num_cached // bs)
        tables = []
        for g in cache.groups:
            first = window_start(g.window, num_cached) // bs
            found = [cache.cached_in(g.group_id, hashes[i]) for i in range(first, end)]
            if any(b is None for b in found):
                break
            tables.append((NULL_BLOCK,) * first + tuple(found))  # type: ignore[arg-type]
        else:
            return MatchResult(num_cached, tuple(tables))
    return NO_MATCH


def export_groups(
    cache: KVCache, token_ids: Sequence[int], cache_salt: str | None, start_token: int
) -> KVPayload:
    """`KVCache.export` for several block groups: the blocks from `start_token` of the longest
    held prefix, each group's own (blocks a sliding group no longer needs are zeros)."""
    bs, hashes = cache.block_size, cache.hasher.hashes(token_ids, cache_salt)
    first = start_token // bs
    last = held_run(cache, hashes, first)
    out = CacheBuffers.empty(cache.desc, last - first, "zeros")  # the layout of `cache.desc`
    for g in cache.groups:
        blocks = needed(cache, g, first, last)
        ids = [cache.cached_in(g.group_id, hashes[i]) for i in blocks]
        _copy_group(cache, g, out, [i - first for i in blocks], ids, to_pool=False)
    tokens = tuple(token_ids[start_token : last * bs])
    return KVPayload(start_token, tokens, tuple(hashes[first:last]), out)


def export_group_layer(
    cache: KVCache, layer_id: int, block_tables: Sequence[Sequence[int]], blocks: slice
) -> dict[str, torch.Tensor]:
    """`KVCache.export_layer` for several block groups: the layer's buffers over `blocks`,
    its group's blocks the prefix of `blocks.stop` needs copied from its pool slot, zeros for
    the rest. A needed block the sliding window already released is an error, never zeros."""
    group_id, slot = cache.plan.layer_slots[layer_id]
    group = cache.groups[group_id]
    wanted = needed(cache, group, blocks.start, blocks.stop)
    ids = [block_tables[group_id][i] for i in wanted]
    if NULL_BLOCK in ids:
        raise ValueError(f"export_layer: layer {layer_id}'s window released a block it needs")
    storage = cache.storages[group.pool_id]
    specs = layer_buffer_specs(cache.desc, layer_id, blocks.stop - blocks.start)
    out = {s.key: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    if ids:
        pos = torch.tensor([i - blocks.start for i in wanted], dtype=torch.long)
        index = torch.tensor(ids, dtype=torch.long)
        for slot_spec, spec in zip(layer_buffer_specs(storage.desc, slot, 1), specs, strict=True):
            pooled = storage.buffers.tensors[slot_spec.key]
            dim = spec.dim("B")
            out[spec.key].index_copy_(dim, pos, pooled.index_select(dim, index))
    return out


def import_groups(
    cache: KVCache, token_ids: Sequence[int], cache_salt: str | None, payload: KVPayload
) -> ImportResult:
    """`KVCache.import_blocks` for several block groups: the longest prefix the payload
    completes and the pool has room for; per group, the blocks it needs and lacks are placed."""
    bs, hashes = cache.block_size, cache.hasher.hashes(token_ids, cache_salt)
    held = held_run(cache, hashes)
    first, last = payload.start_token // bs, min(payload.end_token // bs, len(hashes))
    if payload.start_token % bs or held < first or last <= held:
        return ImportResult(held * bs, 0)
    for end in range(last, held, -1):
        plan = _placement(cache, hashes, first, end, payload.end_token)
        if plan is not None:
            src = payload.cache
            if src.desc != cache.desc:  # one conversion into the pools' layout
                src = convert(src, cache.desc, num_tokens=(end - first) * bs)
            keys = cache.hasher.keys_of(hashes, token_ids, first, end)
            return ImportResult(end * bs, _place(cache, plan, src, first, keys))
    return ImportResult(held * bs, 0)


# per group: (the cached blocks its prefix needs, pinned meanwhile; the block indices to place)
Placement = list[tuple[list[int], list[int]]]


def _placement(
    cache: KVCache, hashes: Sequence[bytes], first: int, end: int, sent_end: int
) -> Placement | None:
    """What importing blocks `first .. end-1` for a prefix of `end` blocks takes, or None:
    a block needed before `first` is missing, a pool lacks room, or a sliding group needs
    tokens the payload (sent for a prefix of `sent_end` tokens) did not carry."""
    plan: Placement = []
    room = [p.num_free for p in cache.pools]
    bs = cache.block_size
    for g in cache.groups:
        wanted = max(window_start(g.window, end * bs), first * bs)  # from the payload
        if end * bs > first * bs and wanted < window_start(g.window, sent_end):
            return None  # zeros there: the sender's window had moved on
        pinned, todo = [], []
        for i in needed(cache, g, 0, end):
            block = cache.cached_in(g.group_id, hashes[i])
            if block is not None:
                pinned.append(block)
            elif i < first:
                return None  # the payload does not hold it
            else:
                todo.append(i)
        pool = cache.pools[g.pool_id]
        room[g.pool_id] -= len(todo) + pool.num_free_of(pinned)
        plan.append((pinned, todo))
    return plan if min(room) >= 0 else None


def _place(
    cache: KVCache, plan: Placement, src: CacheBuffers, first: int, keys: list[BlockKey]
) -> int:
    """Write each group's planned blocks into new blocks of its pool, indexed under their keys,
    the blocks it already holds pinned meanwhile; returns how many were placed."""
    placed = 0
    for g, (pinned, todo) in zip(cache.groups, plan, strict=True):
        pool = cache.pools[g.pool_id]
        pool.touch(pinned)
        targets: list[int] = []
        try:
            targets = pool.allocate(len(todo))  # evicted blocks are written down inside
            _copy_group(cache, g, src, [i - first for i in todo], targets, to_pool=True)
            for block_id, i in zip(targets, todo, strict=True):
                placed += pool.cache_block(block_id, keys[i - first], g.group_id)
        finally:
            pool.free(pinned + targets)
    return placed


def _copy_group(
    cache: KVCache, group: BlockGroup, buffers: CacheBuffers, positions: list[int],
    block_ids: list[int], to_pool: bool,
) -> None:  # fmt: skip
    """Copy a group's layers between `buffers` (the model's layout, block `positions[i]`) and
    its pool's slots (block `block_ids[i]`), one index copy per buffer."""
    if not positions:
        return
    storage = cache.storages[group.pool_id]
    if storage.desc.layout.is_cross_layer:  # one tensor holds every slot: no per-layer copy
        raise ValueError("kv layout: a hybrid cache's blocks move in per-layer layouts only")
    pos = torch.tensor(positions, dtype=torch.long)
    ids = torch.tensor(block_ids, dtype=torch.long)
    for slot, layer_id in enumerate(group.layer_ids):
        pairs = zip(
            layer_buffer_specs(storage.desc, slot, 1),
            layer_buffer_specs(cache.desc, layer_id, 1),
            strict=True,
        )
        for slot_spec, layer_spec in pairs:
            pooled = storage.buffers.tensors[slot_spec.key]
            model = buffers.tensors[layer_spec.key]
            dim = slot_spec.dim("B")
            if to_pool:
                pooled.index_copy_(dim, ids, model.index_select(dim, pos))
            else:
                model.index_copy_(dim, pos, pooled.index_select(dim, ids))


def held_tiered(cache: KVCache, keys: Sequence[BlockKey]) -> int:
    """`KVCache.held` for several block groups: the pool's held prefix, extended by the
    longest one the tiers complete (each group's blocks that prefix needs, fetched verified
    and placed into its pool as cached blocks)."""
    hashes = [k.block_hash for k in keys]
    held = held_run(cache, hashes)
    if cache.tiers is None or held == len(keys):
        return held
    stored = {
        g.group_id: cache.tiers.holds([group_key(k, g.group_id) for k in keys[held:]])
        for g in cache.groups
    }
    for end in range(len(keys), held, -1):
        todo = [
            (g, i)
            for g in cache.groups
            for i in needed(cache, g, held, end)
            if cache.cached_in(g.group_id, hashes[i]) is None
        ]
        if all(stored[g.group_id][i - held] for g, i in todo):
            return end if _load(cache, hashes, keys, end, todo) else held
    return held


def _load(
    cache: KVCache, hashes: Sequence[bytes], keys: Sequence[BlockKey], end: int,
    todo: list[tuple[BlockGroup, int]],
) -> bool:  # fmt: skip
    """Fetch and place the (group, block) entries `todo` for a prefix of `end` blocks, the
    pooled blocks it needs pinned meanwhile; False (nothing placed) if any entry is refused
    or a pool lacks room."""
    pools = range(len(cache.pools))
    pinned = {p: [] for p in pools}
    for g in cache.groups:
        for i in needed(cache, g, 0, end):
            if (b := cache.cached_in(g.group_id, hashes[i])) is not None:
                pinned[g.pool_id].append(b)
    by_pool = {p: [(g, i) for g, i in todo if g.pool_id == p] for p in pools}
    for p, pool in enumerate(cache.pools):
        if len(by_pool[p]) > pool.num_free - pool.num_free_of(pinned[p]):
            return False
    found = {
        p: cache.pool_tiers[p].fetch([group_key(keys[i], g.group_id) for g, i in by_pool[p]])
        for p in pools
    }
    if any((found[p].extent if found[p] else 0) < len(by_pool[p]) for p in pools):
        return False
    for p in pools:
        _place_loaded(cache, p, pinned[p], by_pool[p], found[p], keys)
    return True


def _place_loaded(
    cache: KVCache, pool_id: int, pinned: list[int], todo: list[tuple[BlockGroup, int]],
    found: CacheBuffers | None, keys: Sequence[BlockKey],
) -> None:  # fmt: skip
    pool, storage = cache.pools[pool_id], cache.storages[pool_id]
    pool.touch(pinned)
    targets: list[int] = []
    try:
        targets = pool.allocate(len(todo))  # evicted blocks are written down inside
        if targets:
            storage.write_blocks(found, targets)  # found[j] is todo[j]'s block
        for block_id, (g, i) in zip(targets, todo, strict=True):
            pool.cache_block(block_id, keys[i], g.group_id)
    finally:
        pool.free(pinned + targets)
