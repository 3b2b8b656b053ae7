"""Container: every malformed input and every writer misuse raises its own typed error."""

from __future__ import annotations

import io
import struct

import pytest

from kvabi.abi.descriptor import Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import DescriptorError, IncompatibleError, KvabiError, ShapeError
from kvabi.wire import (
    BadMagicError,
    ChecksumError,
    ContainerError,
    ContainerMeta,
    ContainerWriter,
    FormatError,
    LayerSection,
    TruncatedError,
    VersionError,
    container_bytes,
    iter_layers,
    read_container,
)
from tests.wire.container_cases import (
    ATTN,
    DESCRIPTORS,
    TINY,
    filled,
    reseal_meta,
    section_offsets,
    tiny,
)


def test_iter_layers_yields_good_layers_then_refuses_the_corrupt_one() -> None:
    data = bytearray(container_bytes(filled(DESCRIPTORS["paged_KBNHC_bf16"], 2), [1, 2, 3]))
    data[section_offsets(data)[1] + 40] ^= 1
    items = iter_layers(io.BytesIO(bytes(data)))
    assert isinstance(next(items), ContainerMeta)
    assert isinstance(next(items), LayerSection)
    with pytest.raises(ChecksumError, match="layer 1"):
        next(items)


def test_truncation_at_every_offset() -> None:
    _, _, data = tiny()
    for n in range(len(data)):
        with pytest.raises(TruncatedError):
            read_container(data[:n])
        with pytest.raises(TruncatedError):
            list(iter_layers(io.BytesIO(data[:n])))


def _patched(data: bytes, offset: int, new: bytes, reseal: bool = False) -> bytearray:
    out = bytearray(data)
    out[offset : offset + len(new)] = new
    if reseal:
        reseal_meta(out)
    return out


def test_refusals_name_what_differs() -> None:
    _, _, data = tiny()
    cases = [
        (_patched(data, 0, b"KVABJ"), BadMagicError, "magic"),
        (_patched(data, 8, struct.pack("<H", 2)), VersionError, "major version 2"),
        (_patched(data, 12, struct.pack("<I", 4)), VersionError, "flags 0x4"),
        (_patched(data, 40, b"X"), ChecksumError, "meta checksum"),
        (_patched(data, 28, struct.pack("<I", 2), reseal=True), FormatError, "2 sections"),
        (_patched(data, 420, b"\x01"), FormatError, "meta padding"),
        (_patched(data, 448, b"KVSX"), BadMagicError, "section 0"),
        (_patched(data, 452, struct.pack("<I", 1)), FormatError, "holds layer 1, expected layer 0"),
        (_patched(data, 456, struct.pack("<Q", 255)), FormatError, "payload_len 255"),
        (_patched(data, 472, b"\x01"), FormatError, "reserved"),
        (_patched(data, 500, b"\xff"), ChecksumError, "layer 0"),
        (_patched(data, 740, b"\x01"), FormatError, "layer 0.*padding"),
        (_patched(data, 768, b"KVEX"), BadMagicError, "end marker"),
        (_patched(data, 772, struct.pack("<I", 2)), FormatError, "counts 2 sections"),
        (_patched(data, 776, b"\x00"), ChecksumError, "section checksums"),
        (_patched(data, 790, b"\x01"), FormatError, "zero"),
        (bytearray(data + b"\x00"), FormatError, "1 bytes follow the end record"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            read_container(bad)


def test_descriptor_of_unknown_major_inside_a_valid_container() -> None:
    _, _, data = tiny()
    at = data.index(b'"kvabi":"1.0"') + len('"kvabi":"')
    with pytest.raises(DescriptorError, match="major version 2"):
        read_container(_patched(data, at, b"2", reseal=True))


def test_expect_checks_the_model() -> None:
    _, _, data = tiny()
    assert read_container(data, expect=TINY.model).desc == TINY
    other = ModelSpec((LayerSpec("attn", 1, 8, 8),), fingerprint="other-model")
    with pytest.raises(IncompatibleError, match="fingerprint 'other-model' != 'tiny'"):
        read_container(data, expect=other)
    wider = ModelSpec((LayerSpec("attn", 2, 8, 8),), fingerprint="tiny")
    with pytest.raises(IncompatibleError, match="layer 0"):
        list(iter_layers(io.BytesIO(data), expect=wider))


def test_section_out_of_order_is_refused() -> None:
    data = bytearray(container_bytes(filled(DESCRIPTORS["per_token_head_int8"], 2), [1, 2, 3]))
    first, second = section_offsets(data)
    size = second - first
    data[first:second], data[second : second + size] = (
        data[second : second + size],
        data[first:second],
    )
    with pytest.raises(FormatError, match="section 0 holds layer 1, expected layer 0"):
        read_container(data)


def test_writer_refusals() -> None:
    desc = DESCRIPTORS["paged_KBNHC_bf16"]
    cache = filled(desc, 1)
    good = {"0": cache.tensors["0"]}
    writer = ContainerWriter(io.BytesIO(), desc, [1, 2])
    with pytest.raises(ContainerError, match="layer 0 comes next"):
        writer.write_layer(1, {"1": cache.tensors["1"]})
    with pytest.raises(ShapeError, match="descriptor names"):
        writer.write_layer(0, {"x": cache.tensors["0"]})
    with pytest.raises(ShapeError, match="bfloat16"):
        writer.write_layer(0, {"0": cache.tensors["0"].float()})
    with pytest.raises(ShapeError, match=r"\[2, 1, 4, 2, 16\]"):
        writer.write_layer(0, {"0": filled(desc, 2).tensors["0"]})
    writer.write_layer(0, good)
    with pytest.raises(ContainerError, match=r"layers \[1\]"):
        writer.close()
    with pytest.raises(ValueError, match="token_ids"):
        ContainerWriter(io.BytesIO(), desc, [1, -2])
    with pytest.raises(ValueError, match="block_hashes"):
        ContainerWriter(io.BytesIO(), desc, [1, 2], [b"short"])


def test_cross_layer_layouts_are_refused() -> None:
    desc = Descriptor(ModelSpec((ATTN, ATTN)), Layout(axes="LKBNHC", block_size=4))
    with pytest.raises(ValueError, match="convert"):
        ContainerWriter(io.BytesIO(), desc, [1])


def test_every_error_is_a_kvabi_error() -> None:
    for error in (
        ContainerError,
        TruncatedError,
        BadMagicError,
        VersionError,
        ChecksumError,
        FormatError,
    ):
        assert issubclass(error, KvabiError) and issubclass(error, ContainerError)
