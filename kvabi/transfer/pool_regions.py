"""A block pool's memory as a peer reads it: where each buffer's blocks lie, which runs of
blocks one READ can move, and the checksums both ends take of the blocks a transfer moves.

A pool's buffer (one tensor of `CacheBuffers`) keeps its block axis B after some outer axes
(none for NHD/HND blocks; the K/V plane axis for `KBNHC`; the layer axis for a cross-layer
layout) and before the block's own contents, which are contiguous. So a block of one buffer
is `prod(outer)` extents of `block_bytes`, and blocks `b .. b+n-1` are `prod(outer)` extents of
`n * block_bytes`: a READ between two pools of one descriptor moves one extent per outer index
per run of blocks consecutive on both sides (`paired_runs`), not one per block.

The checksum of a buffer's blocks is xxh3-64 over their bytes in this order: outer index
(row-major), then block in the given order. It does not depend on where the blocks lie, so
the sender takes it over its blocks and the receiver over the blocks they landed in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import xxhash

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.transfer.errors import TransferError


@dataclass(frozen=True)
class PoolRegion:
    """One buffer of a pool: its key, base address and block geometry (in bytes)."""

    key: str
    base: int
    num_blocks: int
    block_stride: int  # bytes from block b to b + 1
    block_bytes: int  # a block's contiguous bytes at one outer index
    outer_shape: tuple[int, ...]
    outer_strides: tuple[int, ...]

    def to_msg(self) -> list:
        return [
            self.key, self.base, self.num_blocks, self.block_stride, self.block_bytes,
            list(self.outer_shape), list(self.outer_strides),
        ]  # fmt: skip

    @classmethod
    def from_msg(cls, msg: object) -> PoolRegion:
        if not isinstance(msg, list) or len(msg) != 7 or not isinstance(msg[0], str):
            raise TransferError("malformed pool region")
        ints, shape, strides = msg[1:5], msg[5], msg[6]
        if not isinstance(shape, list) or not isinstance(strides, list):
            raise TransferError("malformed pool region")
        if not all(isinstance(x, int) for x in [*ints, *shape, *strides]):
            raise TransferError("malformed pool region")
        return cls(msg[0], *ints, tuple(shape), tuple(strides))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each outer index's byte offset from `base`, row-major."""
        indices = itertools.product(*map(range, self.outer_shape))
        return tuple(
            sum(i * s for i, s in zip(x, self.outer_strides, strict=True)) for x in indices
        )

    def matches(self, other: PoolRegion) -> bool:
        """Whether blocks of `other` and of this region hold the same bytes the same way."""
        same = (self.key, self.block_bytes, self.outer_shape)
        return same == (other.key, other.block_bytes, other.outer_shape)


def pool_regions(pool: CacheBuffers) -> list[PoolRegion]:
    """`pool`'s buffers in key order, each as a region; a buffer whose blocks are not
    contiguous (a tiled layout's block axis inside a tile) raises `ValueError`."""
    regions = []
    for spec in buffer_specs(pool.desc, pool.extent):
        t = pool.tensors[spec.key]
        d, size = spec.dim("B"), t.element_size()
        inner = math.prod(t.shape[d + 1 :])
        if not t[(0,) * d].is_contiguous() or t.stride(d) != inner:
            raise ValueError(f"buffer {spec.key!r}: its blocks are not contiguous extents")
        regions.append(
            PoolRegion(
                spec.key, t.data_ptr(), t.shape[d], t.stride(d) * size, inner * size,
                tuple(t.shape[:d]), tuple(s * size for s in t.stride()[:d]),
            )
        )  # fmt: skip
    return regions


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(src_block, dst_block, count)` runs covering `src_ids[i] -> dst_ids[i]` in order, each
    as long as both sides stay consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and (last := runs[-1])[0] + last[2] == s and last[1] + last[2] == d:
            runs[-1] = (last[0], last[1], last[2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def read_extents(
    src: Sequence[PoolRegion], dst: Sequence[PoolRegion], runs: Sequence[tuple[int, int, int]]
) -> list[tuple[int, int, int]]:
    """`(dst_addr, src_addr, num_bytes)` for every outer index of every buffer and run."""
    extents = []
    for s, d in zip(src, dst, strict=True):
        for s_off, d_off in zip(s.offsets, d.offsets, strict=True):
            for s_block, d_block, n in runs:
                src_addr = s.base + s_off + s_block * s.block_stride
                extents.append(
                    (d.base + d_off + d_block * d.block_stride, src_addr, n * s.block_bytes)
                )
    return extents


def block_sums(
    pool: CacheBuffers, block_ids: Sequence[int], keys: Sequence[str] | None = None
) -> dict[str, int]:
    """Per buffer key (of `keys`, default all), the checksum of blocks `block_ids` (the
    module's order)."""
    runs = [(b, n) for b, _, n in paired_runs(block_ids, block_ids)]  # consecutive blocks
    sums = {}
    for spec in buffer_specs(pool.desc, pool.extent):
        if keys is not None and spec.key not in keys:
            continue
        t, d = pool.tensors[spec.key], spec.dim("B")
        h = xxhash.xxh3_64()
        for index in itertools.product(*map(range, t.shape[:d])):
            blocks = t[index]  # [num_blocks, ...], contiguous blocks
            for b, n in runs:
                h.update(_bytes(blocks[b : b + n]))
        sums[spec.key] = h.intdigest()
    return sums


def _bytes(t: torch.Tensor) -> object:
    """A contiguous tensor's bytes, without a copy (a uint8 array over its memory)."""
    return t.reshape(-1).view(torch.uint8).numpy()
