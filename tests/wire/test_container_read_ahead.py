"""`iter_layers(stream, into=buffer)`: the container read ahead into one caller's buffer, the
tensors views of it, every check as without it."""

from __future__ import annotations

import io

import pytest
import torch

from kvabi.wire import container_bytes, iter_layers
from kvabi.wire.container import LayerSection
from kvabi.wire.errors import ChecksumError, FormatError, TruncatedError
from tests.wire.container_cases import DESCRIPTORS, filled, raw, section_offsets


class _Trickle(io.RawIOBase):
    """Hands out at most `step` bytes per read."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data, self._pos, self._step = data, 0, step

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = min(self._step, len(buf), len(self._data) - self._pos)
        buf[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def _case() -> tuple[object, bytes]:
    cache = filled(DESCRIPTORS["unpaged_separate_HCT_f16"], 4)
    return cache, container_bytes(cache, [5, 6, 7, 8])


@pytest.mark.parametrize("step", [7, 1 << 20])
def test_sections_are_verified_views_of_the_buffer(step):
    cache, data = _case()
    buffer = bytearray(len(data))
    items = list(iter_layers(_Trickle(data, step), into=memoryview(buffer)))
    assert bytes(buffer) == data  # read to the end record, nothing past it
    sections = [s for s in items if isinstance(s, LayerSection)]
    assert [s.layer_id for s in sections] == [0, 2]
    for section in sections:
        for key, t in section.tensors.items():
            assert raw(t) == raw(cache.tensors[key])
    offset = data.index(raw(cache.tensors["0.k"]))
    sections[0].tensors["0.k"].view(torch.uint8).view(-1)[0] = data[offset] ^ 0xFF
    assert buffer[offset] == data[offset] ^ 0xFF  # zero copy: the tensor is the buffer's bytes


def test_a_buffer_smaller_than_the_container_is_refused_not_grown():
    _, data = _case()
    with pytest.raises(TruncatedError, match=f"container's {len(data) - 64} bytes end first"):
        list(iter_layers(io.BytesIO(data), into=memoryview(bytearray(len(data) - 64))))


def test_a_corrupt_section_is_refused_as_without_a_buffer():
    _, data = _case()
    bad = bytearray(data)
    bad[-100] ^= 0xFF  # in the last section's payload
    with pytest.raises(ChecksumError, match="layer 2 is corrupt"):
        list(iter_layers(io.BytesIO(bytes(bad)), into=memoryview(bytearray(len(data)))))


@pytest.mark.parametrize("step", [7, 64, 1000, 1 << 20])
def test_each_section_is_hashed_as_it_arrives_and_a_flipped_byte_is_caught(step):
    """Section checksums are computed as the bytes arrive, however the reads fall: a byte
    flipped in any section's checked header bytes or its payload (first, last) is refused for
    that layer."""
    _, data = _case()
    layers = [0, 2]
    starts = section_offsets(data)
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(data) - 32
        for offset in (start + 4, start + 15, start + 32, end - 1):
            bad = bytearray(data)
            bad[offset] ^= 0x10
            with pytest.raises((ChecksumError, FormatError), match=f"layer {layers[index]}"):
                list(iter_layers(_Trickle(bytes(bad), step), into=memoryview(bytearray(len(bad)))))
