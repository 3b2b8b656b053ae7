"""Container 1.1: a sliding-window layer's section holds only its window's tail (docs/ABI.md
5.4, golden vector 6.4). The expected bytes are built here with `struct.pack` and slices of
the input tensors, independently of the writer."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
import xxhash

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.wire import FormatError, VersionError, container_bytes, read_container
from kvabi.wire import container_format as fmt
from tests.wire.container_cases import reseal_meta, section_offsets

# layer 0 slides over 3 tokens, layer 1 sees everything; f16, KBNHC, blocks of 4; 9 tokens
WINDOWED = Descriptor(
    ModelSpec((LayerSpec(ATTN, 1, 8, 8, window=3), LayerSpec(ATTN, 1, 8, 8)), "tiny"),
    Layout(axes="KBNHC", block_size=4, dtype="f16"),
)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]
GOLDEN_HEADER_HEX = "4b56414249000d0a010001000100000073010000090000000000000002000000"
GOLDEN_LEN = 1248
GOLDEN_SHA256 = "9dd4784468c328cf552479507a75801fe4ef92aae705132241b3a0710388d543"


def windowed() -> tuple[CacheBuffers, bytes]:
    cache = CacheBuffers.empty(WINDOWED, 3)
    for i, key in enumerate(("0", "1")):
        t = cache.tensors[key]  # [K=2, B=3, N=4, H=1, C=8]
        t.copy_((torch.arange(t.numel()) + 1000 * i).to(torch.float16).reshape(t.shape))
    return cache, container_bytes(cache, TOKENS)


def test_golden_windowed_container() -> None:
    cache, data = windowed()
    desc_len = len(WINDOWED.to_json())
    header = struct.pack("<8sHHIIIII", b"KVABI\x00\r\n", 1, 1, 1, desc_len, 9, 0, 2)
    assert data[:32] == header and data[:32].hex() == GOLDEN_HEADER_HEX
    first, second = section_offsets(data)
    assert (desc_len, first, second) == (371, 448, 768)  # meta ends at 447
    # window_start(3, 9) = 7: layer 0 keeps block 1 (tokens 4..7) and 2; layer 1 all three
    tail = cache.tensors["0"][:, 1:].contiguous().numpy().tobytes()  # [2, 2, 4, 1, 8]: 256 B
    whole = cache.tensors["1"].contiguous().numpy().tobytes()  # [2, 3, 4, 1, 8]: 384 B
    assert struct.unpack_from("<4sIQ", data, first) == (b"KVSC", 0, 256)
    assert data[first + 32 : first + 32 + 256] == tail
    assert struct.unpack_from("<4sIQ", data, second) == (b"KVSC", 1, 384)
    assert data[second + 32 : second + 32 + 384] == whole
    sums = [
        xxhash.xxh3_64_intdigest(data[o : o + 16] + p) for o, p in ((first, tail), (second, whole))
    ]
    assert [struct.unpack_from("<Q", data, o + 16)[0] for o in (first, second)] == sums
    end_sum = xxhash.xxh3_64_intdigest(struct.pack("<2Q", *sums))
    assert data[1216:] == struct.pack("<4sIQ", b"KVEN", 2, end_sum) + bytes(16)
    assert len(data) == GOLDEN_LEN == fmt.container_size(WINDOWED, 9, 0)
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256


def test_read_back_the_dropped_blocks_are_zeros() -> None:
    cache, data = windowed()
    back = read_container(data, expect=WINDOWED.model)
    assert torch.equal(back.cache.tensors["1"], cache.tensors["1"])
    assert not back.cache.tensors["0"][:, :1].any()
    assert torch.equal(back.cache.tensors["0"][:, 1:], cache.tensors["0"][:, 1:])


@pytest.mark.parametrize(
    ("num_tokens", "firsts"), [(0, [0, 0]), (3, [0, 0]), (8, [1, 0]), (9, [1, 0])]
)
def test_the_tail_starts_at_the_block_of_the_first_key_the_next_query_sees(num_tokens, firsts):
    assert [x.first for x in fmt.section_layouts(WINDOWED, num_tokens)] == firsts


def test_a_uniform_models_container_stays_1_0() -> None:
    plain = Descriptor(ModelSpec((LayerSpec(ATTN, 1, 8, 8),), "tiny"), WINDOWED.layout)
    data = container_bytes(CacheBuffers.empty(plain, 1, "zeros"), [1, 2])
    assert struct.unpack_from("<HHI", data, 8) == (1, 0, 0)


def test_a_reader_refuses_an_unknown_flag_and_a_whole_section_claimed_as_a_tail() -> None:
    _, data = windowed()
    unknown = bytearray(data)
    struct.pack_into("<I", unknown, 12, 2)
    reseal_meta(unknown)
    with pytest.raises(VersionError, match="flags 0x2"):
        read_container(bytes(unknown))
    short = bytearray(data)
    struct.pack_into("<I", short, 12, 0)  # says: whole sections; layer 0 holds a tail
    reseal_meta(short)
    with pytest.raises(FormatError, match=r"section 0 \(layer 0\): payload_len 256"):
        read_container(bytes(short))
