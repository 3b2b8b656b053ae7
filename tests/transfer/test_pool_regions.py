"""Pool regions: the addresses a peer READs blocks at, the runs one READ moves, and the
checksums both ends take; checked against the tensors' own element addresses."""

from __future__ import annotations

import math

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.catalog import catalog_model
from kvabi.abi.presets import preset_descriptor
from kvabi.transfer.errors import TransferError
from kvabi.transfer.pool_regions import (
    PoolRegion,
    block_sums,
    paired_runs,
    pool_regions,
    read_extents,
)


def pool(preset: str, num_blocks: int = 6, seed: int = 0) -> CacheBuffers:
    desc = preset_descriptor(preset, catalog_model("smollm2-135m"), block_size=4)
    cache = CacheBuffers.empty(desc, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def test_runs_are_as_long_as_both_sides_stay_consecutive():
    assert paired_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [
        (3, 0, 3),
        (9, 3, 1),
        (10, 7, 1),
        (2, 8, 1),
    ]
    assert paired_runs([], []) == []


@pytest.mark.parametrize(
    "preset", ["vllm-flash-attn", "vllm-flash-attn-hnd", "sglang-mha", "vllm-flash-attn-xl"]
)
def test_a_regions_block_lies_where_the_tensor_keeps_it(preset):
    cache = pool(preset)
    regions = pool_regions(cache)
    assert [r.key for r in regions] == list(cache.tensors)
    for region in regions:
        t = cache.tensors[region.key]
        d = len(region.outer_shape)
        first_outer = t[(0,) * d]
        last_outer = t[tuple(n - 1 for n in region.outer_shape)]
        offsets = list(region.offsets)
        assert len(offsets) == math.prod(region.outer_shape)
        assert region.base + offsets[0] + 2 * region.block_stride == first_outer[2].data_ptr()
        assert region.base + offsets[-1] + 5 * region.block_stride == last_outer[5].data_ptr()
        assert region.block_bytes == first_outer[0].numel() * t.element_size()
        assert PoolRegion.from_msg(region.to_msg()) == region


def test_reading_the_extents_moves_exactly_the_blocks_asked():
    src, dst = pool("vllm-flash-attn", 8, seed=1), pool("vllm-flash-attn", 6, seed=2)
    src_ids, dst_ids = [5, 6, 7, 0], [1, 2, 0, 3]
    before = {k: t.clone() for k, t in dst.tensors.items()}
    extents = read_extents(pool_regions(src), pool_regions(dst), paired_runs(src_ids, dst_ids))
    # KBNHC: per buffer, K and V each get the runs (5, 1, 2), (7, 0, 1), (0, 3, 1)
    assert len(extents) == len(dst.tensors) * 2 * 3
    for dst_addr, src_addr, n in extents:  # what a READ does, one extent at a time
        src_bytes = _bytes_at(src, src_addr, n)
        _bytes_at(dst, dst_addr, n).copy_(src_bytes)
    for key, t in dst.tensors.items():
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(t[:, d], src.tensors[key][:, s])
        for untouched in (4, 5):
            assert torch.equal(t[:, untouched], before[key][:, untouched])
    assert block_sums(src, src_ids) == block_sums(dst, dst_ids)


def test_checksums_follow_the_bytes_not_the_placement():
    a = pool("vllm-flash-attn-hnd", 6, seed=3)  # KBHNC: blocks on dim 1
    b = CacheBuffers(a.desc, {k: t.flip(1).clone() for k, t in a.tensors.items()})
    assert block_sums(a, [0, 1, 2, 3]) == block_sums(b, [5, 4, 3, 2])
    assert block_sums(a, [0, 1]) != block_sums(a, [1, 0])
    key = next(iter(b.tensors))
    b.tensors[key][1, 4].view(torch.uint8).view(-1)[7] ^= 1  # a bit of V in block 4 (a's 1)
    sums, other = block_sums(a, [0, 1, 2, 3]), block_sums(b, [5, 4, 3, 2])
    assert [k for k in sums if sums[k] != other[k]] == [key]


def _bytes_at(cache: CacheBuffers, addr: int, n: int) -> torch.Tensor:
    """The `n` bytes of `cache` at address `addr`, as a uint8 view of its tensor."""
    for t in cache.tensors.values():
        flat = t.view(-1).view(torch.uint8)
        offset = addr - flat.data_ptr()
        if offset >= 0 and offset + n <= flat.numel():
            return flat[offset : offset + n]
    raise AssertionError(f"address {addr:#x} is in none of the buffers")


@pytest.mark.parametrize(
    "msg",
    [
        ["0", 1, 2, 3, 4, 5, []],  # outer shape not a list
        ["0", 1, 2, 3, 4, [2], [1.5]],  # a stride not an int
        ["0", 1, 2, 3, [4], [], []],
        [0, 1, 2, 3, 4, [], []],  # key not a string
        ["0", 1, 2, 3, 4, []],
    ],
)
def test_a_malformed_region_is_a_typed_error(msg):
    with pytest.raises(TransferError, match="malformed pool region"):
        PoolRegion.from_msg(msg)
