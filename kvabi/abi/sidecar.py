"""Conversion of sidecar planes (the V3.2 indexer's keys, a V4 centries layer's state): stored
alike in every layout, so a cache's sidecar moves byte for byte; only the blocking (block size,
paged or not) may differ for the indexer's per-token records; state records, one per block,
move block for block between caches of one block size."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import STATE, Layout
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.indexer_record import token_views


def copy_sidecars(
    layer_id: int,
    src: CacheBuffers,
    outs: Sequence[CacheBuffers],
    num_tokens: int | None,
    src_block_ids: Sequence[int] | None,
    dst_block_ids: Sequence[int] | None,
) -> None:
    """Copy layer `layer_id`'s sidecar buffers from `src` into every shard of `outs` (a
    sidecar is replicated on every TP shard, as MLA is). `num_tokens=None`: the whole cache."""
    layer = src.desc.model.layers[layer_id]
    for plane in layer.sidecar_planes:
        key = f"{layer_id}.{plane.name}"
        if plane.name == STATE:  # one record per block, at its end (equal block sizes)
            s_blocks = _blocks(src.desc.layout, num_tokens, src_block_ids, src.extent)
            for out in outs:
                d_blocks = _blocks(out.desc.layout, num_tokens, dst_block_ids, out.extent)
                out.tensors[key][d_blocks] = src.tensors[key][s_blocks]
            continue
        s_codes, s_scales = token_views(src.tensors[key], plane.width)
        if num_tokens is None:
            s_pos = (slice(None),)
        else:
            s_pos = _positions(src.desc.layout, num_tokens, src_block_ids)
        for out in outs:
            d_codes, d_scales = token_views(out.tensors[key], plane.width)
            if num_tokens is None:
                d_codes.copy_(s_codes)
                d_scales.copy_(s_scales)
                continue
            d_pos = _positions(out.desc.layout, num_tokens, dst_block_ids)
            d_codes[d_pos] = s_codes[s_pos]
            d_scales[d_pos] = s_scales[s_pos]


def _blocks(
    layout: Layout, num_tokens: int | None, block_ids: Sequence[int] | None, extent: int
) -> torch.Tensor | slice:
    """The blocks holding a sequence's `num_tokens` tokens (None: every block)."""
    if num_tokens is None:
        return slice(None)
    needed = -(-num_tokens // layout.block_size)
    table = torch.arange(needed) if block_ids is None else torch.tensor(list(block_ids))
    if len(table) < needed or (needed and int(table[:needed].max()) >= extent):
        raise IncompatibleError(f"block table names too few blocks for {num_tokens} tokens")
    return table[:needed]


def _positions(
    layout: Layout, num_tokens: int, block_ids: Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, slot) of tokens 0 .. num_tokens - 1 in a sidecar's token views."""
    t = torch.arange(num_tokens)
    if not layout.is_paged:
        return t, torch.zeros_like(t)
    bs = layout.block_size
    num_blocks = -(-num_tokens // bs)
    table = torch.arange(num_blocks) if block_ids is None else torch.tensor(list(block_ids))
    if len(table) < num_blocks:
        raise IncompatibleError(
            f"block table names {len(table)} blocks; {num_tokens} need {num_blocks}"
        )
    return table[t // bs], t % bs
