"""Decode side: received blocks go into the engine's pool as cached blocks under its own block
hashes, so the request admitted next finds them like any prefix-cache hit (and computes only
the tokens after them). The same path TieredCache.promote takes for lower-tier blocks.

Runs on the engine's thread, between steps. The payload may be in another layout and block
size than the pool: `KVStorage.write_blocks` converts. Only whole blocks of this engine's size
are placed; blocks the pool already holds are not duplicated (their hash is indexed once);
blocks that would not extend the pooled prefix are not placed (nothing could reach them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvabi.abi.block_hash import hash_blocks
from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_pool import BlockKey
from kvabi.disagg.transport import KVPayload
from kvabi.engine.engine import LLMEngine


@dataclass(frozen=True)
class InjectResult:
    """What an injection did: tokens the pool now holds for the prompt, blocks newly placed."""

    num_cached_tokens: int
    num_placed_blocks: int


def num_held_tokens(engine: LLMEngine, token_ids: tuple[int, ...], salt: str | None) -> int:
    """Tokens of the prompt's leading full blocks the pool holds (what a fetch may skip)."""
    if engine.prefix is None:
        return 0
    return engine.prefix.num_pooled(_hashes(engine, token_ids, salt)) * engine.config.block_size


def inject_blocks(
    engine: LLMEngine, token_ids: tuple[int, ...], salt: str | None, payload: KVPayload
) -> InjectResult:
    """Place `payload`'s blocks of the prompt `token_ids` into free pool blocks, cached."""
    if engine.prefix is None:
        raise ValueError("decode role: the engine needs its prefix cache to take blocks")
    bs, pool = engine.config.block_size, engine.pool
    hashes = _hashes(engine, token_ids, salt)
    held = engine.prefix.num_pooled(hashes)
    first, last = payload.start_token // bs, min(payload.end_token // bs, len(hashes))
    pooled = [pool.cached_block(h) for h in hashes[:held]]
    room = pool.num_free - pool.num_free_of(pooled)
    last = min(last, first + room)
    if payload.start_token % bs or held < first or last <= held:
        return InjectResult(held * bs, 0)
    parent = hashes[first - 1] if first else None
    keys = engine.prefix.keys(hashes[first:last], token_ids[first * bs :], parent)
    return InjectResult(last * bs, _place(engine, payload, keys, pooled))


def _place(engine: LLMEngine, payload: KVPayload, keys: list[BlockKey], pooled: list[int]) -> int:
    """Write the payload's blocks into new pool blocks and index them under `keys`; returns
    how many were new to the pool. All end up free (unreferenced), cached or empty."""
    pool = engine.pool
    pool.touch(pooled)  # pinned: the allocation below must not evict the prefix they extend
    targets = pool.allocate(len(keys))
    if engine.tiers is not None:
        engine.tiers.write_down_evicted()  # what those blocks held goes down first
    engine.storage.write_blocks(payload.cache, targets)  # converts layout and block size
    # cache_block is False for a block the pool already holds: that copy is freed empty
    placed = sum(pool.cache_block(b, key) for b, key in zip(targets, keys, strict=True))
    pool.free(pooled + targets)
    return placed


def _hashes(engine: LLMEngine, token_ids: tuple[int, ...], salt: str | None) -> list[bytes]:
    root = engine.prefix.root(salt)
    return hash_blocks(token_ids, engine.config.block_size, root)


def fetch_start(num_held: int, block_size: int, peer_block_size: int) -> int:
    """Where a fetch can start: the held tokens, rounded down to a boundary of both block
    sizes (the sender sends whole blocks of its size; we place whole blocks of ours)."""
    step = math.lcm(block_size, peer_block_size)
    return num_held // step * step


def stage_payload(payload: KVPayload, desc: Descriptor) -> KVPayload:
    """The payload's whole blocks of `desc`'s block size, converted to `desc`'s layout.

    Runs off the engine thread (a conversion across block sizes goes token by token), so that
    `inject_blocks` then only copies blocks between equal layouts. The block hashes are kept
    (the sender's); `inject_blocks` uses its own.
    """
    bs = desc.layout.block_size
    num_tokens = payload.end_token // bs * bs - payload.start_token
    if num_tokens <= 0 or payload.start_token % bs:
        return KVPayload(payload.start_token, (), (), CacheBuffers.empty(desc, 0))
    cache = payload.cache
    if cache.desc.layout.block_size != bs:
        cache = _reblock(cache, bs, num_tokens)  # exactly num_tokens / bs blocks
    if cache.desc != desc:  # whole blocks, equal sizes: one strided copy per plane
        cache = convert(
            cache, desc, num_tokens=None if cache.extent * bs == num_tokens else num_tokens
        )
    tokens = payload.token_ids[:num_tokens]
    return KVPayload(payload.start_token, tokens, payload.block_hashes, cache)


def _reblock(cache: CacheBuffers, block_size: int, num_tokens: int) -> CacheBuffers:
    """The first `num_tokens` (a multiple of `block_size`) of `cache` in NHD blocks of
    `block_size`: one strided copy into NHD blocks of the cache's own size, where block and
    slot axes are adjacent, then a view that regroups them (no token-by-token path)."""
    nhd = cache.desc.with_layout(axes="KBNHC", planes="axis", v_axes="", name="")
    whole = convert(cache, nhd)  # per layer [2, blocks, slots, heads, dim]
    tensors = {
        key: t.flatten(1, 2)[:, :num_tokens].unflatten(1, (num_tokens // block_size, block_size))
        for key, t in whole.tensors.items()
    }
    return CacheBuffers(nhd.with_layout(block_size=block_size), tensors)
