"""LMCache 0.5.6's EncodedKV blob (`lmcache/v1/kv_codec/encoded_kv.py`): parsed and written.

A blob is one layer's K and V: a little-endian header (76 fixed bytes, the scale shape, the
three payload lengths, identity string pairs, a CRC32 of the payload), then K (its native
dtype), V (fp8 e4m3 in LMCache's AsymK16V8 codec) and V's fp32 scales. `parse_blob` keeps
every header field as read (dtype ids, reserved, string pairs in order), so `blob_bytes`
of a parsed blob gives back its bytes. `blob_buffers` / `blob_from_buffers` map a blob to
and from kvabi buffers of one attention layer, tokens-major (`THC`). docs/PEERS.md.

Checks run in this order, each with its typed error: at least 76 bytes
(`BlobHeaderTruncatedError`), the magic (`BlobMagicError`), the header version
(`BlobVersionError`), the variable header fields (`BlobHeaderTruncatedError`), dtype ids
(`BlobDtypeError`), scale scope (`BlobVersionError`), payload length
(`BlobPayloadTruncatedError`), CRC32 (`BlobChecksumError`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from kvabi.interop.errors import (
    BlobChecksumError,
    BlobDtypeError,
    BlobHeaderTruncatedError,
    BlobMagicError,
    BlobPayloadTruncatedError,
    BlobVersionError,
)

MAGIC = b"LMCKV\x01\x00\x01"
VERSION = 1
FIXED = struct.Struct("<8s6H7q")  # magic, version, scope, 3 dtype ids, reserved, 7 int64
assert FIXED.size == 76
MAX_SCALE_DIMS = 8  # LMCache refuses more
# LMCache's lmcache/v1/protocol.py INT_TO_DTYPE; 0 is None (no tensor). 1 and 2 are both
# float16 (torch.half is torch.float16), and LMCache writes 2.
INT_TO_DTYPE: dict[int, torch.dtype | None] = {
    0: None,
    1: torch.float16,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float32,
    5: torch.float64,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
DTYPE_TO_INT = {dt: i for i, dt in INT_TO_DTYPE.items() if i != 1}
SCALE_SCOPES = ("per_tensor", "per_layer_head", "per_page_head", "external")
IDENTITY_KEYS = (  # LMCache's CodecHashes._CHECK_ORDER: written, in this order, every time
    "model_id",
    "model_revision_hash",
    "tokenizer_hash",
    "rope_config_hash",
    "attention_backend",
    "kv_layout",
)


@dataclass(frozen=True)
class BlobHeader:
    """Every field of an EncodedKV header, as stored (-1 is LMCache's "unset")."""

    scale_scope: int = 0  # index into SCALE_SCOPES
    k_dtype_id: int = 3
    v_dtype_id: int = 7
    scale_dtype_id: int = 4
    reserved: int = 0
    layer_id: int = -1
    chunk_id: int = -1
    chunk_size: int = -1
    page_size: int = -1
    kv_head_count: int = -1
    head_dim: int = -1
    scale_shape: tuple[int, ...] = ()
    k_len: int = 0
    v_len: int = 0
    scale_len: int = 0
    identity: tuple[tuple[str, str], ...] = tuple((k, "") for k in IDENTITY_KEYS)
    crc32: int = 0

    @property
    def payload_len(self) -> int:
        return self.k_len + self.v_len + self.scale_len

    def ident(self, key: str) -> str:
        """The identity string `key` (the last pair of that key wins, as in LMCache), or ""."""
        return next((v for k, v in reversed(self.identity) if k == key), "")


@dataclass(frozen=True)
class EncodedBlob:
    """A parsed blob: its header and its payload (K bytes, then V bytes, then scale bytes)."""

    header: BlobHeader
    payload: bytes

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V (flat, their stored dtypes) and the scales (shaped `scale_shape`)."""
        h, buf = self.header, bytearray(self.payload)
        k = _flat(buf[: h.k_len], h.k_dtype_id)
        v = _flat(buf[h.k_len : h.k_len + h.v_len], h.v_dtype_id)
        s = _flat(buf[h.k_len + h.v_len :], h.scale_dtype_id).reshape(h.scale_shape)
        return k, v, s


def parse_blob(data: bytes | bytearray | memoryview) -> EncodedBlob:
    """Parse and verify an EncodedKV blob (trailing bytes past the payload are ignored, as
    LMCache ignores them). Raises a `BlobError` subclass on any bad input."""
    mv = memoryview(data)
    if len(mv) < FIXED.size:
        raise BlobHeaderTruncatedError(f"blob of {len(mv)} B: the fixed header is 76 B")
    magic, version, scope, k_id, v_id, s_id, reserved, *ints, n_scale = FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise BlobMagicError(f"bad magic {bytes(magic)!r}; an LMCache blob starts {MAGIC!r}")
    if version != VERSION:
        raise BlobVersionError(f"EncodedKV header version {version}; kvabi reads {VERSION}")
    scale_shape, lens, identity, crc, off = _read_tail(mv, n_scale)
    for name, i in (("k", k_id), ("v", v_id), ("scale", s_id)):
        if i not in INT_TO_DTYPE:
            raise BlobDtypeError(f"{name} dtype id {i} is not in LMCache's DTYPE_TO_INT")
    if scope >= len(SCALE_SCOPES):
        raise BlobVersionError(f"scale scope {scope}; known: {SCALE_SCOPES}")
    header = BlobHeader(scope, k_id, v_id, s_id, reserved, *ints, scale_shape, *lens,
                        identity, crc)  # fmt: skip
    return EncodedBlob(header, _read_payload(mv, off, header))


def blob_bytes(blob: EncodedBlob) -> bytes:
    """The blob's bytes: its header as stored, the CRC computed from the payload."""
    h = blob.header
    if len(blob.payload) != h.payload_len:
        raise BlobPayloadTruncatedError(
            f"payload of {len(blob.payload)} B; the header declares {h.payload_len} B"
        )
    fixed = FIXED.pack(MAGIC, VERSION, h.scale_scope, h.k_dtype_id, h.v_dtype_id,
                       h.scale_dtype_id, h.reserved, h.layer_id, h.chunk_id, h.chunk_size,
                       h.page_size, h.kv_head_count, h.head_dim, len(h.scale_shape))  # fmt: skip
    parts = [fixed, struct.pack(f"<{len(h.scale_shape)}q", *h.scale_shape)]
    parts.append(struct.pack("<3qH", h.k_len, h.v_len, h.scale_len, len(h.identity)))
    parts += [_pack_str(s) for pair in h.identity for s in pair]
    parts.append(struct.pack("<I", zlib.crc32(blob.payload)))
    return b"".join(parts) + blob.payload


def dtype_id(dtype: torch.dtype) -> int:
    """LMCache's id of a torch dtype (float16 is 2, as LMCache writes it)."""
    if dtype not in DTYPE_TO_INT:
        raise BlobDtypeError(f"{dtype} has no LMCache dtype id")
    return DTYPE_TO_INT[dtype]


def _read_tail(
    mv: memoryview, n_scale: int
) -> tuple[tuple[int, ...], tuple[int, int, int], tuple[tuple[str, str], ...], int, int]:
    if not 0 <= n_scale <= MAX_SCALE_DIMS:
        raise BlobVersionError(f"scale_shape_n {n_scale}: LMCache allows 0..{MAX_SCALE_DIMS}")
    off = _need(mv, FIXED.size, 8 * n_scale, "scale_shape")
    scale_shape = struct.unpack_from(f"<{n_scale}q", mv, FIXED.size)
    off = _need(mv, off, 26, "payload lengths and string count")
    k_len, v_len, s_len, n_pairs = struct.unpack_from("<3qH", mv, off - 26)
    pairs = []
    for _ in range(n_pairs):
        key, off = _unpack_str(mv, off)
        value, off = _unpack_str(mv, off)
        pairs.append((key, value))
    off = _need(mv, off, 4, "CRC32")
    (crc,) = struct.unpack_from("<I", mv, off - 4)
    if min(k_len, v_len, s_len) < 0:
        raise BlobPayloadTruncatedError(f"negative payload length in {(k_len, v_len, s_len)}")
    return tuple(scale_shape), (k_len, v_len, s_len), tuple(pairs), crc, off


def _read_payload(mv: memoryview, off: int, h: BlobHeader) -> bytes:
    if off + h.payload_len > len(mv):
        raise BlobPayloadTruncatedError(
            f"header ends at {off} and declares a {h.payload_len} B payload; the blob has "
            f"{len(mv) - off} B after the header"
        )
    payload = bytes(mv[off : off + h.payload_len])
    crc = zlib.crc32(payload)
    if crc != h.crc32:
        raise BlobChecksumError(f"payload CRC32 {crc:#010x}; the header declares {h.crc32:#010x}")
    return payload


def _need(mv: memoryview, off: int, size: int, what: str) -> int:
    if off + size > len(mv):
        raise BlobHeaderTruncatedError(f"blob ends at {len(mv)} B, inside its {what} at {off}")
    return off + size


def _unpack_str(mv: memoryview, off: int) -> tuple[str, int]:
    off = _need(mv, off, 2, "string length")
    (length,) = struct.unpack_from("<H", mv, off - 2)
    end = _need(mv, off, length, "identity string")
    try:
        return bytes(mv[off:end]).decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise BlobHeaderTruncatedError(f"identity string at {off} is not UTF-8: {exc}") from None


def _pack_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise BlobHeaderTruncatedError(f"identity string of {len(raw)} B: at most 65535")
    return struct.pack("<H", len(raw)) + raw


def _flat(buf: bytearray, dtype_id_: int) -> torch.Tensor:
    dtype = INT_TO_DTYPE[dtype_id_]
    if dtype is None:
        if buf:
            raise BlobDtypeError(f"dtype id 0 (none) with {len(buf)} B of payload")
        return torch.empty(0, dtype=torch.uint8)
    if len(buf) % dtype.itemsize:
        raise BlobPayloadTruncatedError(f"{len(buf)} B is not a whole number of {dtype}")
    return torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
