"""Container: golden bytes, bit-exact round trips, zero-copy mapping, layer-wise streaming."""

from __future__ import annotations

import gc
import hashlib
import io
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from kvabi.abi.buffers import layer_buffer_specs
from kvabi.abi.errors import ShapeError
from kvabi.wire import (
    ContainerMeta,
    ContainerWriter,
    container_bytes,
    container_size,
    iter_layers,
    read_container,
    write_container,
)
from tests.wire.container_cases import (
    DESCRIPTORS,
    TINY,
    TINY_TOKENS,
    filled,
    raw,
    section_offsets,
    tiny,
)

# Pinned golden vector (docs/ABI.md, section 6): the tiny container's header and whole bytes.
TINY_HEADER_HEX = "4b56414249000d0a010000000000000034010000050000000100000001000000"
TINY_LEN = 800
TINY_COMPAT_DIGEST = "19d6cbdefb60629f13a39f5604a72011"
TINY_BLOCK_HASH = "c9a6c3d53c5c43246d15fee5b3e6771ba23f05ed788bed1ce95dea01640d5fba"
TINY_META_CHECKSUM = 0x0CFEFF05F080D0B6
TINY_SECTION_CHECKSUM = 0x6289555370BA4585
TINY_END_CHECKSUM = 0xE50E2B8551F3D532
TINY_SHA256 = "ae9d8882bece581d38a722c175d448e5d5431d9bce4b4f3be2a2a85c08313c50"


def test_golden_tiny_container() -> None:
    _, hashes, data = tiny()
    desc_len = len(TINY.to_json())
    expected_header = struct.pack("<8sHHIIIII", b"KVABI\x00\r\n", 1, 0, 0, desc_len, 5, 1, 1)
    assert data[:32] == expected_header
    assert data[:32].hex() == TINY_HEADER_HEX
    assert len(data) == TINY_LEN == container_size(TINY, 5, 1)
    meta_end = 32 + desc_len + 4 * 5 + 32
    assert data[32 : 32 + desc_len] == TINY.to_json().encode()
    assert data[32 + desc_len : meta_end - 32] == struct.pack("<5I", *TINY_TOKENS)
    assert data[meta_end - 32 : meta_end] == hashes[0]
    assert TINY.model.compat_digest() == TINY_COMPAT_DIGEST
    assert hashes[0].hex() == TINY_BLOCK_HASH
    meta_sum = xxhash.xxh3_64_intdigest(data[:meta_end])
    assert data[meta_end : meta_end + 8] == struct.pack("<Q", meta_sum)
    assert data[meta_end + 8 : 448] == bytes(48)
    assert (meta_end + 8, section_offsets(data)) == (400, [448])
    payload = data[448 + 32 : 448 + 32 + 256]
    assert payload == torch.arange(128, dtype=torch.float16).numpy().tobytes()
    assert data[448 + 32 + 256 : 768] == bytes(32)
    assert struct.unpack_from("<4sIQ", data, 448) == (b"KVSC", 0, 256)
    section_sum = xxhash.xxh3_64_intdigest(data[448:464] + payload)
    assert struct.unpack_from("<QQ", data, 464) == (section_sum, 0)
    end_sum = xxhash.xxh3_64_intdigest(struct.pack("<Q", section_sum))
    assert data[768:] == struct.pack("<4sIQ", b"KVEN", 1, end_sum) + bytes(16)
    assert (meta_sum, section_sum, end_sum) == (
        TINY_META_CHECKSUM,
        TINY_SECTION_CHECKSUM,
        TINY_END_CHECKSUM,
    )
    assert hashlib.sha256(data).hexdigest() == TINY_SHA256


@pytest.mark.parametrize("name", sorted(DESCRIPTORS))
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_round_trip_bit_exact(name: str, num_tokens: int) -> None:
    desc = DESCRIPTORS[name]
    extent = -(-num_tokens // desc.layout.block_size) if desc.layout.is_paged else num_tokens
    cache = filled(desc, extent, seed=num_tokens)
    tokens = list(range(7, 7 + num_tokens))
    hashes = [bytes([i]) * 32 for i in range(num_tokens // 4)]
    data = container_bytes(cache, tokens, hashes)
    assert len(data) == container_size(desc, num_tokens, len(hashes))
    got = read_container(data)
    assert (got.desc, got.token_ids, got.block_hashes) == (desc, tokens, hashes)
    assert sorted(got.cache.tensors) == sorted(cache.tensors)
    for key, t in cache.tensors.items():
        assert raw(got.cache.tensors[key]) == raw(t), key
        assert got.cache.tensors[key].shape == t.shape


def test_shared_layers_have_no_section() -> None:
    desc = DESCRIPTORS["unpaged_separate_HCT_f16"]
    data = container_bytes(filled(desc, 3), [1, 2, 3])
    layer_ids = [struct.unpack_from("<I", data, pos + 4)[0] for pos in section_offsets(data)]
    assert layer_ids == [0, 2]
    assert struct.unpack_from("<I", data, 28) == (2,)


def test_payload_buffers_are_aligned_in_spec_order() -> None:
    desc = DESCRIPTORS["unpaged_separate_HCT_f16"]
    cache = filled(desc, 3)
    data = container_bytes(cache, [1, 2, 3])
    pos = section_offsets(data)[1]  # layer 2: k [3,1,8] f16 = 48 bytes, v [1,8,3] = 48 bytes
    specs = layer_buffer_specs(desc, 2, 3)
    assert [s.key for s in specs] == ["2.k", "2.v"]
    assert struct.unpack_from("<Q", data, pos + 8) == (64 + 48,)
    payload = data[pos + 32 : pos + 32 + 112]
    assert payload[:48] == raw(cache.tensors["2.k"])
    assert payload[48:64] == bytes(16)
    assert payload[64:] == raw(cache.tensors["2.v"])


def test_writes_only_the_blocks_the_tokens_use() -> None:
    desc = DESCRIPTORS["paged_KBNHC_bf16"]
    cache = filled(desc, 5)
    got = read_container(container_bytes(cache, list(range(9))))
    assert got.cache.extent == 3
    assert raw(got.cache.tensors["0"]) == raw(cache.tensors["0"][:, :3])
    with pytest.raises(ShapeError, match="need 3 blocks"):
        container_bytes(filled(desc, 2), list(range(9)))


def _mapping_of(path: str) -> list[tuple[int, int]]:
    with open("/proc/self/maps") as f:
        lines = [line.split() for line in f if line.rstrip().endswith(path)]
    return [tuple(int(x, 16) for x in fields[0].split("-")) for fields in lines]


def test_read_path_is_zero_copy_mmap(tmp_path: Path) -> None:
    desc = DESCRIPTORS["paged_KBNHC_bf16"]
    cache = filled(desc, 3)
    path = tmp_path / "seq.kvabi"
    size = write_container(path, cache, list(range(10)))
    assert size == path.stat().st_size
    got = read_container(path)
    ranges = _mapping_of(str(path))
    assert ranges, "the file is not mapped"
    for key, t in got.cache.tensors.items():
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(lo <= start and end <= hi for lo, hi in ranges), key
        assert raw(t) == raw(cache.tensors[key])
    before = path.read_bytes()
    got.cache.tensors["0"].zero_()  # copy-on-write: the file is untouched
    assert path.read_bytes() == before
    layer_1 = got.cache.tensors["1"]
    del got
    gc.collect()
    assert raw(layer_1) == raw(cache.tensors["1"])  # the mapping lives as long as its views


def test_bytearray_input_is_viewed_in_place_and_bytes_are_copied() -> None:
    _, _, data = tiny()
    buf = bytearray(data)
    read_container(buf).cache.tensors["0"].view(torch.uint8).reshape(-1)[0] = 0xAB
    assert buf[448 + 32] == 0xAB
    read_container(data).cache.tensors["0"].view(torch.uint8).reshape(-1)[0] = 0xCD
    assert data[448 + 32] == 0  # immutable input: the reader copied it


def test_iter_layers_streams_verified_sections() -> None:
    desc = DESCRIPTORS["unpaged_separate_HCT_f16"]
    cache = filled(desc, 4)
    stream = io.BytesIO(container_bytes(cache, [5, 6, 7, 8]) + b"next message")
    items = list(iter_layers(stream, expect=desc.model))
    meta, sections = items[0], items[1:]
    assert isinstance(meta, ContainerMeta)
    assert (meta.desc, meta.token_ids, meta.block_hashes, meta.extent) == (
        desc,
        [5, 6, 7, 8],
        [],
        4,
    )
    assert [s.layer_id for s in sections] == [0, 2]
    for layer_id, tensors in sections:
        for key, t in tensors.items():
            assert raw(t) == raw(cache.tensors[key]), (layer_id, key)
    assert stream.read() == b"next message"


class _Trickle(io.RawIOBase):
    """A non-seekable stream that hands out at most 7 bytes per read."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = min(7, len(buf), len(self._data) - self._pos)
        buf[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def test_writer_streams_to_iter_layers_in_small_reads() -> None:
    desc = DESCRIPTORS["mla_concat"]
    cache = filled(desc, 2)
    sink = io.BytesIO()
    writer = ContainerWriter(sink, desc, list(range(8)))
    for layer_id in (0, 1):
        specs = layer_buffer_specs(desc, layer_id, 2)
        writer.write_layer(layer_id, {s.key: cache.tensors[s.key] for s in specs})
    writer.close()
    assert sink.getvalue() == container_bytes(cache, list(range(8)))
    items = list(iter_layers(_Trickle(sink.getvalue())))
    assert [raw(s.tensors[str(s.layer_id)]) for s in items[1:]] == [
        raw(cache.tensors["0"]),
        raw(cache.tensors["1"]),
    ]
