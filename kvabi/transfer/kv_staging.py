"""Decode side, before `KVCache.import_blocks` places received blocks in the pool: where a
fetch starts (`fetch_start`), and the payload restaged off the engine thread into whole blocks
of the engine's size and layout (`stage_payload`), so the import only copies blocks.
"""

from __future__ import annotations

import math

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.kv_groups import window_start
from kvabi.transfer.transport import KVPayload


def fetch_start(num_held: int, block_size: int, peer_block_size: int) -> int:
    """Where a fetch can start: the held tokens, rounded down to a boundary of both block
    sizes (the sender sends whole blocks of its size; we place whole blocks of ours)."""
    step = math.lcm(block_size, peer_block_size)
    return num_held // step * step


def stage_payload(payload: KVPayload, desc: Descriptor) -> KVPayload:
    """The payload's whole blocks of `desc`'s block size, converted to `desc`'s layout.

    Runs off the engine thread (a conversion across block sizes goes token by token), so that
    `KVCache.import_blocks` then only copies blocks between equal layouts. The block hashes
    are kept (the sender's); the import uses its own.
    """
    bs = desc.layout.block_size
    num_tokens = payload.end_token // bs * bs - payload.start_token
    if num_tokens <= 0 or payload.start_token % bs:
        return KVPayload(payload.start_token, (), (), CacheBuffers.empty(desc, 0))
    if num_tokens < len(payload.token_ids) and _windows_moved(payload, desc):
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


def _windows_moved(payload: KVPayload, desc: Descriptor) -> bool:
    """Whether a sliding layer's tokens before the payload's end are zeros in it (its window
    at the end had left them), so a shorter prefix of it is not whole."""
    return any(
        window_start(x.window, payload.end_token) > payload.start_token
        for x in desc.model.layers
        if x.has_kv
    )


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
