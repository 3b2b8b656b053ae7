"""Whole blocks copied between two caches of one descriptor: each buffer's rows along its block
axis, moved as the widest integer words the row allows.

Between identical layouts there is nothing to convert, and per-token, per-plane views only cost
time: a block of a buffer is `inner` contiguous bytes (everything after its block axis), once per
`outer` index (everything before it: the K/V plane axis of a joint layout). `copy_rows` moves
them with one gather and one scatter per (buffer, outer index), or plain slice copies where
both block lists run in consecutive stretches (a fresh pool, a fresh host slab). PyTorch's
index kernels move a 16-bit element at a time several times slower than a 64-bit word, so rows
are viewed as int64 where their size and alignment allow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs

MAX_STRETCHES = 8  # more stretches than this: one gather and one scatter instead


def copy_blocks(
    src: CacheBuffers, dst: CacheBuffers, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """`dst`'s blocks `dst_ids[i]` = `src`'s blocks `src_ids[i]`, every buffer (sidecars too);
    both caches of one paged descriptor, their blocks dense runs of memory (`can_copy`)."""
    if src.desc != dst.desc or not src.desc.layout.is_paged:
        raise ValueError("copy_blocks: both caches must be of one paged descriptor")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks: {len(src_ids)} source blocks, {len(dst_ids)} targets")
    if not len(src_ids):
        return
    stretches = _stretches(src_ids, dst_ids)
    s_index = d_index = None
    if len(stretches) > MAX_STRETCHES:
        s_index = torch.as_tensor(src_ids, dtype=torch.long)
        d_index = torch.as_tensor(dst_ids, dtype=torch.long)
    for spec in buffer_specs(src.desc, 1):
        dim = spec.dim("B")
        for s_rows, d_rows in zip(
            _rows(src.tensors[spec.key], dim), _rows(dst.tensors[spec.key], dim), strict=True
        ):
            if s_index is None:
                for s0, d0, n in stretches:
                    d_rows[d0 : d0 + n].copy_(s_rows[s0 : s0 + n])
            else:
                d_rows.index_copy_(0, d_index, s_rows.index_select(0, s_index))


def can_copy(cache: CacheBuffers) -> bool:
    """Whether `copy_blocks` can take blocks from or into `cache`."""
    lay = cache.desc.layout
    return (
        lay.is_paged
        and not lay.is_tiled
        and all(has_rows(cache.tensors[s.key], s.dim("B")) for s in buffer_specs(cache.desc, 1))
    )


def _stretches(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source start, target start, length) of the runs where both lists count up by one;
    stops counting past MAX_STRETCHES."""
    out: list[tuple[int, int, int]] = []
    s0, d0, n = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
            continue
        out.append((s0, d0, n))
        if len(out) > MAX_STRETCHES:
            return out
        s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out


def has_rows(t: torch.Tensor, dim: int) -> bool:
    """Whether each block of `t` (along `dim`) is, per index of the axes before it, one dense
    run of memory: the axes after `dim` laid out C-contiguously, whatever the others' strides
    (a contiguous buffer; a bulk read's views, whose B axis steps over entries)."""
    expected = 1
    inner = zip(reversed(t.shape[dim + 1 :]), reversed(t.stride()[dim + 1 :]), strict=True)
    for size, stride in inner:
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _rows(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Per index of the axes before `dim`, a `[blocks, words]` view of `t`'s blocks."""
    if not has_rows(t, dim):
        raise ValueError("copy_blocks: a buffer's blocks are not dense runs of memory")
    inner = 1
    for size in t.shape[dim + 1 :]:
        inner *= size
    row_bytes, step = inner * t.element_size(), t.stride(dim) * t.element_size()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if (row_bytes | step | t.data_ptr()) % w.itemsize == 0)  # fmt: skip
    outer = [()]
    for size in t.shape[:dim]:
        outer = [(*o, i) for o in outer for i in range(size)]
    rows = []
    for index in outer:
        base = t[index] if index else t  # [blocks, *inner]
        flat = base.as_strided((t.shape[dim], inner), (t.stride(dim), 1))
        rows.append(flat.view(torch.uint8).view(word))
    return rows
