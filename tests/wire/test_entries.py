"""Tier entries in bulk (kvabi/wire/entries.py): byte for byte the writer's one-block
containers, and verified as strictly as `read_container`, which names what is wrong with any
entry the bulk reader stops at."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvabi.abi.descriptor import Descriptor, Layout
from kvabi.abi.presets import preset_descriptor
from kvabi.wire import ChecksumError, FormatError, container_bytes, read_container
from kvabi.wire.container import Container
from kvabi.wire.entries import (
    _buffer_views,
    _buffer_views_sliced,
    entry_shape,
    read_entries,
    write_entries,
)
from tests.abi import test_centries
from tests.abi.strategies import descriptors
from tests.wire.container_cases import DESCRIPTORS, filled, raw

N = 5


def _keys(desc: Descriptor, n: int = N) -> tuple[list[list[int]], list[bytes]]:
    bs = desc.layout.block_size
    ids = [[7 * i + j for j in range(bs)] for i in range(n)]
    return ids, [bytes([i + 1]) * 32 for i in range(n)]


def _one_by_one(desc: Descriptor, blocks, ids, hashes) -> list[bytes]:
    """What `container_bytes` writes for each block on its own."""
    out = []
    for i in range(len(hashes)):
        one = {
            s: t.narrow(spec.dim("B"), i, 1)
            for (s, t), spec in zip(blocks.tensors.items(), _specs(desc), strict=True)
        }
        out.append(container_bytes(type(blocks)(desc, one), ids[i], [hashes[i]]))
    return out


def _specs(desc):
    from kvabi.abi.buffers import buffer_specs

    return buffer_specs(desc, 1)


def _same_blocks(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        raw(a.tensors[k]) == raw(b.tensors[k]) for k in a.tensors
    )


CASES = {
    "paged_KBNHC_bf16": DESCRIPTORS["paged_KBNHC_bf16"],
    "mla_concat": DESCRIPTORS["mla_concat"],
    "per_token_head_int8": DESCRIPTORS["per_token_head_int8"],
    "compressed_entries": test_centries.desc(block_size=8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bulk_entries_are_the_writers_bytes_and_read_back(name):
    desc = CASES[name]
    shape = entry_shape(desc)
    blocks = filled(desc, N)
    ids, hashes = _keys(desc)
    entries = write_entries(shape, blocks, ids, hashes)
    assert entries == _one_by_one(desc, blocks, ids, hashes)
    n, back = read_entries(shape, entries, ids, hashes)
    assert n == N and _same_blocks(back, blocks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=descriptors(), n=st.integers(1, 4))
def test_random_geometries_write_the_writers_bytes(desc, n):
    shape = entry_shape(desc)
    if shape is None:  # the one-by-one path serves those (a cross-layer one: no container)
        lay = desc.layout
        assert not lay.is_paged or lay.is_tiled or lay.is_cross_layer
        return
    blocks = filled(desc, n, seed=n)
    ids, hashes = _keys(desc, n)
    entries = write_entries(shape, blocks, ids, hashes)
    assert entries == _one_by_one(desc, blocks, ids, hashes)
    count, back = read_entries(shape, entries, ids, hashes)
    assert count == n and _same_blocks(back, blocks)


def _flip(entry: bytes | memoryview, at: int) -> bytes:
    entry = bytes(entry)
    return entry[:at] + bytes([entry[at] ^ 0x10]) + entry[at + 1 :]


DESC = DESCRIPTORS["paged_KBNHC_bf16"]
SHAPE = entry_shape(DESC)
S0 = SHAPE.sections[0]
DAMAGE = {  # where a byte flips -> what read_container says
    "descriptor": (SHAPE.tokens_at - 3, ChecksumError),
    "meta checksum": (SHAPE.meta_sum_at, ChecksumError),
    "meta padding": (SHAPE.sections[0].head_at - 1, FormatError),
    "section marker": (S0.head_at, Exception),
    "section checksum": (S0.head_at + 16, ChecksumError),
    "section reserved": (S0.head_at + 24, FormatError),
    "payload": (S0.payload_at + 5, ChecksumError),
    "section padding": (SHAPE.sections[1].head_at - 1, FormatError),
    "end summary": (SHAPE.end_at + 8, ChecksumError),
    "end zeros": (SHAPE.size - 1, FormatError),
}


@pytest.mark.parametrize("where", sorted(DAMAGE))
def test_the_bulk_reader_stops_at_a_damaged_entry_the_full_reader_refuses(where):
    at, error = DAMAGE[where]
    blocks = filled(DESC, N)
    ids, hashes = _keys(DESC)
    entries = write_entries(SHAPE, blocks, ids, hashes)
    entries[2] = _flip(entries[2], at)
    n, back = read_entries(SHAPE, entries, ids, hashes)
    assert n == 2 and _same_blocks(back, _narrow(blocks, 2))
    with pytest.raises(error):
        read_container(entries[2], expect=DESC.model)


def _narrow(blocks, n):
    return type(blocks)(
        blocks.desc,
        {s.key: blocks.tensors[s.key].narrow(s.dim("B"), 0, n) for s in _specs(blocks.desc)},
    )


def test_the_bulk_reader_stops_at_another_block_a_short_entry_or_none():
    blocks = filled(DESC, N)
    ids, hashes = _keys(DESC)
    entries = write_entries(SHAPE, blocks, ids, hashes)
    other_ids = [list(t) for t in ids]
    other_ids[1][0] += 1
    assert read_entries(SHAPE, entries, other_ids, hashes)[0] == 1  # other tokens
    assert read_entries(SHAPE, entries, ids, [hashes[0], hashes[0], *hashes[2:]])[0] == 1
    assert read_entries(SHAPE, [*entries[:3], entries[3][:-1]], ids, hashes)[0] == 3
    assert read_entries(SHAPE, [entries[0], None], ids, hashes)[0] == 1
    assert read_entries(SHAPE, [], ids, hashes) == (0, None)


def test_an_entry_in_another_layout_is_left_to_the_full_reader():
    """Not refused: `read_container` takes it (a layout the codec converts)."""
    hnd = Descriptor(DESC.model, Layout("KBHNC", DESC.layout.block_size, "bf16"))
    blocks = filled(hnd, 1)
    ids, hashes = _keys(hnd, 1)
    entry = write_entries(entry_shape(hnd), blocks, ids, hashes)[0]
    assert read_entries(SHAPE, [entry], ids, hashes) == (0, None)
    assert isinstance(read_container(entry, expect=DESC.model), Container)


def test_views_of_a_bulk_read_convert_like_any_cache():
    """The blocks come back as strided views (B steps over entries): a conversion reads them."""
    from kvabi.abi.convert import convert

    desc = preset_descriptor("vllm-flash-attn", DESC.model, block_size=4, dtype="bf16")
    blocks = filled(desc, N)
    ids, hashes = _keys(desc)
    shape = entry_shape(desc)
    _, back = read_entries(shape, write_entries(shape, blocks, ids, hashes), ids, hashes)
    hnd = preset_descriptor("vllm-flash-attn-hnd", DESC.model, block_size=4, dtype="bf16")
    assert _same_blocks(convert(back, hnd), convert(blocks, hnd))
    pool = filled(desc, 9, seed=3)
    expect = {k: t.clone() for k, t in pool.tensors.items()}
    src, dst = [4, 0, 2], [8, 1, 5]
    convert(back, desc, num_tokens=3 * 4, src_block_ids=src, dst_block_ids=dst, out=pool)
    for key, t in expect.items():
        b = next(s for s in _specs(desc) if s.key == key).dim("B")
        picked = blocks.tensors[key].index_select(b, torch.tensor(src))
        t.index_copy_(b, torch.tensor(dst), picked)
        assert raw(pool.tensors[key]) == raw(t)


@pytest.mark.parametrize("name", sorted(CASES))
def test_strided_views_of_the_rows_are_the_sliced_ones(name):
    desc = CASES[name]
    shape = entry_shape(desc)
    ids, hashes = _keys(desc)
    entries = write_entries(shape, filled(desc, len(hashes)), ids, hashes)
    rows = np.stack([np.frombuffer(e, dtype=np.uint8) for e in entries])
    strided, sliced = _buffer_views(shape, rows), _buffer_views_sliced(shape, rows)
    for key, view in strided.items():
        assert view.shape == sliced[key].shape and view.stride() == sliced[key].stride()
        assert view.data_ptr() == sliced[key].data_ptr()  # the same elements, then
