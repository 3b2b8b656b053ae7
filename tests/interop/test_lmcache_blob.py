"""LMCache EncodedKV blobs without LMCache: header fields, round trips, typed refusals.

The bytes kvabi writes are checked against LMCache's own writer in test_lmcache_peer.py.
"""

import struct
import zlib
from dataclasses import replace

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.cli.main import main
from kvabi.interop.errors import (
    BlobChecksumError,
    BlobDtypeError,
    BlobHeaderTruncatedError,
    BlobMagicError,
    BlobPayloadTruncatedError,
    BlobShapeError,
    BlobVersionError,
)
from kvabi.interop.lmcache_blob import (
    MAGIC,
    BlobHeader,
    EncodedBlob,
    blob_bytes,
    dtype_id,
    parse_blob,
)
from kvabi.interop.lmcache_buffers import blob_buffers, blob_descriptor, blob_from_buffers

NUM_TOKENS, HEADS, DIM = 6, 2, 8


def _cache(dtype: torch.dtype = torch.bfloat16) -> CacheBuffers:
    g = torch.Generator().manual_seed(0)
    desc = blob_descriptor(
        BlobHeader(k_dtype_id=dtype_id(dtype), kv_head_count=HEADS, head_dim=DIM)
    )
    k = torch.randn(NUM_TOKENS, HEADS, DIM, generator=g).to(dtype)  # [tokens, heads, dim]
    v = torch.randn(NUM_TOKENS, HEADS, DIM, generator=g).to(dtype)
    return CacheBuffers(desc, {"0.k": k, "0.v": v})


def _blob() -> bytes:
    return blob_bytes(blob_from_buffers(_cache(), NUM_TOKENS, 0, {"model_id": "m"}))


def _patch(data: bytes, off: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, off, value)
    return bytes(out)


def test_header_fields_are_lmcache_s_layout():
    data = _blob()
    assert data[:8] == MAGIC == b"LMCKV\x01\x00\x01"
    fixed = struct.unpack_from("<8s6H7q", data)
    # version 1, per_tensor, K bf16 (3), V fp8 e4m3 (7), scales f32 (4), reserved 0,
    # layer 0, chunk/chunk_size/page unset, 2 heads, dim 8, scale shape () (0 dims)
    assert fixed[1:] == (1, 0, 3, 7, 4, 0, 0, -1, -1, -1, HEADS, DIM, 0)
    k_len, v_len, s_len, n = struct.unpack_from("<3qH", data, 76)
    assert (k_len, v_len, s_len, n) == (
        NUM_TOKENS * HEADS * DIM * 2,
        NUM_TOKENS * HEADS * DIM,
        4,
        6,
    )
    payload = data[-(k_len + v_len + s_len) :]
    crc = struct.unpack_from("<I", data, len(data) - len(payload) - 4)[0]
    assert crc == zlib.crc32(payload)
    assert parse_blob(data).header.ident("model_id") == "m"


def test_round_trip_is_byte_exact_and_values_hold():
    data = _blob()
    blob = parse_blob(data)
    assert blob_bytes(blob) == data
    cache, back = _cache(), blob_buffers(blob)
    assert torch.equal(back.tensors["0.k"], cache.tensors["0.k"])
    v, got = cache.tensors["0.v"].float(), back.tensors["0.v"].float()
    assert (got - v).abs().max() <= v.abs().max() / 8  # fp8 e4m3: 3 mantissa bits
    assert blob_bytes(blob_from_buffers(back, NUM_TOKENS))[-len(blob.payload) :] == blob.payload


def test_fp16_id_1_is_read_and_kept():
    data = blob_bytes(blob_from_buffers(_cache(torch.float16), NUM_TOKENS))
    assert struct.unpack_from("<H", data, 12)[0] == 2  # LMCache writes float16 as 2
    alias = _patch(data, 12, "<H", 1)  # 1 (torch.half) is float16 too in LMCache's table
    blob = parse_blob(alias)
    assert blob.tensors()[0].dtype == torch.float16
    assert blob_bytes(blob) == alias


@pytest.mark.parametrize("size", [0, 8, 75])
def test_short_header(size):
    with pytest.raises(BlobHeaderTruncatedError):
        parse_blob(_blob()[:size])


def test_bad_magic_is_checked_once_the_fixed_header_is_there():
    data = b"LMCKX" + _blob()[5:]
    with pytest.raises(BlobMagicError):
        parse_blob(data)
    with pytest.raises(BlobHeaderTruncatedError):
        parse_blob(data[:40])


def test_unknown_version_and_scope():
    with pytest.raises(BlobVersionError, match="version 2"):
        parse_blob(_patch(_blob(), 8, "<H", 2))
    with pytest.raises(BlobVersionError, match="scale scope 4"):
        parse_blob(_patch(_blob(), 10, "<H", 4))


@pytest.mark.parametrize("off", [12, 14, 16])
def test_unknown_dtype_id(off):
    with pytest.raises(BlobDtypeError, match="dtype id 9"):
        parse_blob(_patch(_blob(), off, "<H", 9))


def test_truncated_inside_identity_strings():
    with pytest.raises(BlobHeaderTruncatedError):
        parse_blob(_blob()[: 76 + 26 + 5])


def test_truncated_payload():
    with pytest.raises(BlobPayloadTruncatedError):
        parse_blob(_blob()[:-1])


def test_flipped_payload_bit():
    data = bytearray(_blob())
    data[-10] ^= 0x01
    with pytest.raises(BlobChecksumError):
        parse_blob(bytes(data))


def test_other_kv_layout_is_refused():
    blob = parse_blob(_blob())
    pairs = tuple((k, "HND" if k == "kv_layout" else v) for k, v in blob.header.identity)
    hnd = EncodedBlob(replace(blob.header, identity=pairs), blob.payload)
    with pytest.raises(BlobShapeError, match="HND"):
        blob_buffers(parse_blob(blob_bytes(hnd)))


def test_unknown_identity_key_is_refused():
    with pytest.raises(BlobShapeError, match="colour"):
        blob_from_buffers(_cache(), NUM_TOKENS, 0, {"colour": "red"})


def test_f32_k_stays_f32():
    blob = parse_blob(blob_bytes(blob_from_buffers(_cache(torch.float32), NUM_TOKENS)))
    assert blob.header.k_dtype_id == 4
    assert torch.equal(blob_buffers(blob).tensors["0.k"], _cache(torch.float32).tensors["0.k"])


def test_cli_inspect_blob_and_refuse_corrupt(tmp_path, capsys):
    path = tmp_path / "kv.bin"
    path.write_bytes(_blob())
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model_id='m'" in out and "K 192 B  V 96 B  scales 4 B" in out
    path.write_bytes(_blob()[:-3])
    assert main(["inspect", str(path)]) == 1
    assert "declares a 292 B payload" in capsys.readouterr().err
