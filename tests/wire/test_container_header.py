"""The container header as docs/ABI.md 5.2 and 5.7 state it: read whole before it is checked,
and versioned by the container format, not by the descriptor it carries."""

from __future__ import annotations

import io

import pytest

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.text_form import from_text
from kvabi.wire import BadMagicError, TruncatedError, container_bytes, iter_layers, read_container

NOT_A_CONTAINER = [b"", b"XXXX", b"GIF89a", b"\x00" * 31, b"KVABI\x00\r\n" + b"\xff" * 23]


@pytest.mark.parametrize("data", NOT_A_CONTAINER)
def test_an_input_shorter_than_the_header_is_truncated_whatever_its_magic(data):
    with pytest.raises(TruncatedError, match="header"):
        read_container(data)
    with pytest.raises(TruncatedError, match="header"):
        next(iter_layers(io.BytesIO(data)))


def test_a_whole_header_with_another_magic_is_bad_magic():
    with pytest.raises(BadMagicError):
        read_container(b"XXXX" + bytes(60))


@pytest.mark.parametrize(
    ("text", "minor"),
    [
        ("kvabi/1.1 layers=attn:1x16 fp=t rope=post:half axes=BHKNCn16c2 bs=32 dtype=bf16", 0),
        ("kvabi/1.2 layers=attn:1x8,none fp=t rope=post:half axes=KBNHC bs=4 dtype=f16", 0),
        ("kvabi/1.2 layers=swa3:1x8 fp=t rope=post:half axes=KBNHC bs=4 dtype=f16", 1),
        (
            "kvabi/1.3 layers=dsa:512+64+128 fp=t rope=post:half axes=BNHC bs=64 dtype=u8 "
            "quant=fp8_ds_mla planes=concat",
            0,
        ),
    ],
)
def test_the_header_minor_is_the_container_formats_not_the_descriptors(text, minor):
    desc = from_text(text)
    data = container_bytes(CacheBuffers.empty(desc, 1, "zeros"), [1, 2])
    assert (data[8:10], data[10:12], data[12:16]) == (
        b"\x01\x00",
        bytes([minor, 0]),
        bytes([minor, 0, 0, 0]),
    )
    assert read_container(data).desc.version == desc.version
