"""`copy_blocks`: whole blocks between caches of one descriptor, against a plain index copy."""

import pytest
import torch

from kvabi.abi import block_copy
from kvabi.abi.block_copy import can_copy, copy_blocks
from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.descriptor import Descriptor, Layout
from tests.abi import test_centries
from tests.wire.container_cases import DESCRIPTORS, filled, raw

CASES = {
    "joint_KBNHC_bf16": DESCRIPTORS["paged_KBNHC_bf16"],  # K outer: two rows per block
    "separate_BHNC": Descriptor(
        DESCRIPTORS["paged_KBNHC_bf16"].model, Layout("BHNC", 4, "f16", planes="separate")
    ),
    "int8_with_scales": DESCRIPTORS["per_token_head_int8"],
    "mla_concat": DESCRIPTORS["mla_concat"],
    "compressed_with_state": test_centries.desc(block_size=8),
}
IDS = {  # (source blocks, target blocks)
    "one stretch": ([2, 3, 4], [5, 6, 7]),
    "a few stretches": ([0, 1, 5, 2], [9, 10, 3, 4]),
    "scattered": ([7, 1, 4, 0, 9, 2, 8, 3, 6, 5], [3, 8, 0, 9, 1, 6, 2, 7, 4, 5]),
}


def _expected(src: CacheBuffers, dst: CacheBuffers, s: list[int], d: list[int]) -> dict:
    out = {}
    for spec in buffer_specs(src.desc, 1):
        b, t = spec.dim("B"), dst.tensors[spec.key].clone()
        picked = src.tensors[spec.key].index_select(b, torch.tensor(s))
        out[spec.key] = t.index_copy_(b, torch.tensor(d), picked)
    return out


@pytest.mark.parametrize("ids", sorted(IDS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_copy_blocks_is_an_index_copy_of_every_buffer(name, ids):
    desc = CASES[name]
    src, dst = filled(desc, 12, seed=1), filled(desc, 12, seed=2)
    s, d = IDS[ids]
    expected = _expected(src, dst, s, d)
    copy_blocks(src, dst, s, d)
    assert all(raw(dst.tensors[k]) == raw(expected[k]) for k in expected)


def test_many_stretches_take_the_gather_and_scatter_path(monkeypatch):
    desc = CASES["joint_KBNHC_bf16"]
    s, d = IDS["scattered"]
    assert len(block_copy._stretches(s, d)) > block_copy.MAX_STRETCHES
    monkeypatch.setattr(block_copy, "MAX_STRETCHES", 100)  # the same copy as slices
    src, dst = filled(desc, 12, seed=1), filled(desc, 12, seed=2)
    expected = _expected(src, dst, s, d)
    copy_blocks(src, dst, s, d)
    assert all(raw(dst.tensors[k]) == raw(expected[k]) for k in expected)


def test_strided_blocks_copy_and_other_strides_are_refused():
    desc = CASES["separate_BHNC"]
    wide = filled(desc, 20, seed=1)
    every_other = CacheBuffers(  # B steps two blocks: still dense blocks
        desc, {s.key: wide.tensors[s.key][::2] for s in buffer_specs(desc, 1)}
    )
    assert can_copy(every_other)
    dst = filled(desc, 12, seed=2)
    expected = _expected(every_other, dst, [1, 2], [0, 9])
    copy_blocks(every_other, dst, [1, 2], [0, 9])
    assert all(raw(dst.tensors[k]) == raw(expected[k]) for k in expected)
    transposed = {k: t.transpose(2, 3).contiguous().transpose(2, 3) for k, t in dst.tensors.items()}
    assert not can_copy(CacheBuffers(desc, transposed))  # [N, C] not dense within a block
    with pytest.raises(ValueError, match="one paged descriptor"):
        copy_blocks(filled(CASES["mla_concat"], 2), dst, [0], [0])
