"""vLLM's fp8_ds_mla record (docs/ABI.md 3.3, golden vector 6.5): byte-exact encoding, the
dequantising read, and refusals.

The expected bytes are built here without the encoder and without torch's fp8 cast: the e4m3
code comes from a table of all 127 finite magnitudes (nearest, ties to the even code, saturating
at 448), float32 arithmetic from numpy, scales from `struct.pack('<f')`, bf16 as the top half of
the float32 bits (every input here is a bf16 value, as vLLM's kernel reads).
"""

from __future__ import annotations

import bisect
import hashlib
import struct

import numpy as np
import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import decode, encode
from kvabi.abi.descriptor import MLA, Descriptor, LayerSpec, Layout, ModelSpec, Plane
from kvabi.abi.ds_mla_record import decode_records, ds_mla_records_to_latent_rope, encode_records
from kvabi.abi.errors import CodecError, DescriptorError, ShapeError
from kvabi.abi.presets import preset_descriptor

# Pinned once from the hand-built records below; they are also in docs/ABI.md, section 6.5.
GOLDEN_SHA256 = [
    "4baec85f4ee411f8f4028eef6b976762a17a10898b89a885c3945552135f0996",
    "65be7948d1cf6d062a31ec0f6df1490f4ee4459af22732256136a0a1957ae2db",
    "c193b4f8c7dff9405f9efca8a9e18992079186e5b2444c5322ab524c523ab663",
]
GOLDEN_SCALES = [  # the 16 scale bytes of each record, hex
    "9224913c9224913c9224913c9224913c",
    "9224913c000080000000800000008000",  # tiles 1-3: FLT_MIN, the raw float32 0x00800000
    "0000803fdbb6953e00008035dbb6ed3c",  # 1.0, 131 / 448, 2^-20, 13 / 448
]
FLT_MIN = 2.0**-126
E4M3 = [c * 2.0**-9 if c < 8 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]


def _tile(fn) -> list[float]:
    return [fn(k) for k in range(128)]


def _pattern(k: int) -> float:
    return ((37 * k) % 255 - 127) / 16


def golden_inputs() -> np.ndarray:
    """The three tokens of golden vector 6.5: float32 [3, 576], latent then rope."""
    t0 = [_pattern(j) for j in range(512)] + [(i - 32) / 8 for i in range(64)]
    t0[3], t0[512 + 32] = -0.0, -0.0
    t1 = (
        _tile(lambda k: -_pattern(k))
        + _tile(lambda k: 0.0)  # an all-zero tile: scale FLT_MIN
        + _tile(lambda k: (k - 64) * 2.0**-133)  # float32 subnormals: scale FLT_MIN
        + _tile(lambda k: (k - 64) * 2.0**-126)  # amax / 448 below FLT_MIN
        + [(i - 32) * 2.0**-130 for i in range(64)]
    )
    edges = [448, -448, 432, 400, -1.0625, 1.1875, 2**-10, 3 * 2**-10]
    edges += [2**-9, 7 * 2**-9, 15 * 2**-10, 2**-6, -(2**-11), 17, -19, 0.30078125]
    t2 = (
        edges
        + [(k % 64 - 32) / 4 for k in range(16, 128)]  # scale exactly 1: ties at fp8 steps
        + _tile(lambda k: (k - 64) * 2.0 if k < 127 else 131.0)  # 131 / scale > 448: saturates
        + _tile(lambda k: (k - 64) * 2.0**-30 if k < 127 else 448 * 2.0**-20)  # fp8 subnormals
        + [-(k % 13) * 0.75 for k in range(125)]
        + [0.0380859375, 13.0, -0.15234375]  # x / s lands on fp8 ties: x * (1 / s) misses them
        + [65280.0, -3.3895313892515355e38, 2.0**-133, -(2.0**-133)]
        + [(i - 32) / 2 for i in range(4, 64)]
    )
    return np.array([t0, t1, t2], dtype=np.float32)


def _e4m3_byte(x: float) -> int:
    a = min(abs(x), 448.0)  # __NV_SATFINITE
    c = bisect.bisect_left(E4M3, a)  # E4M3[c - 1] < a <= E4M3[c]
    if c > 0:
        below, above = a - E4M3[c - 1], E4M3[c] - a
        if below < above or (below == above and (c - 1) % 2 == 0):
            c -= 1  # the lower neighbour is nearer, or as near and even
    return c | (0x80 if np.signbit(x) else 0)


def _record(token: np.ndarray) -> bytes:
    latent, scales = b"", []
    for i in range(4):
        tile = token[128 * i : 128 * (i + 1)]
        scale = max(np.abs(tile).max() / np.float32(448), np.float32(FLT_MIN))
        scales.append(scale)
        latent += bytes(_e4m3_byte(float(x / scale)) for x in tile)
    rope = b"".join(struct.pack("<f", float(x))[2:] for x in token[512:])
    return latent + struct.pack("<4f", *scales) + rope


def _expected_latent(record: bytes) -> np.ndarray:
    scales = np.frombuffer(record[512:528], dtype="<f4")
    q = [(-1 if b & 0x80 else 1) * E4M3[b & 0x7F] for b in record[:512]]
    return np.float32(q) * np.repeat(scales, 128)


def _golden() -> tuple[np.ndarray, list[bytes]]:
    x = golden_inputs()
    return x, [_record(t) for t in x]


def test_hand_built_records_match_the_pins():
    _, records = _golden()
    assert [hashlib.sha256(r).hexdigest() for r in records] == GOLDEN_SHA256
    assert [r[512:528].hex() for r in records] == GOLDEN_SCALES
    assert records[1][128:256] == bytes(128)  # the all-zero tile
    assert records[2][:16].hex(" ") == "7e fe 7e 7c b8 3a 00 02 01 07 08 08 80 58 da 2a"
    assert records[2][509:512].hex(" ") == "3a 7e ca"
    assert struct.unpack("<f", records[1][516:520])[0] == FLT_MIN


def test_encoder_writes_the_golden_records():
    x, records = _golden()
    got = encode_records(torch.from_numpy(x))
    assert got.dtype == torch.uint8 and got.shape == (3, 656)
    assert [bytes(r.numpy().tobytes()) for r in got] == records


def test_encoder_matches_the_hand_built_records_on_random_bf16_tokens():
    g = torch.Generator().manual_seed(0)
    span = torch.logspace(-30, 30, 48).reshape(48, 1)  # tile amax from tiny to huge
    x = (torch.randn(48, 576, generator=g) * span).bfloat16().float()
    got = encode_records(x)
    assert [bytes(r.numpy().tobytes()) for r in got] == [_record(t) for t in x.numpy()]


def test_codec_entry_and_batch_shape_write_the_same_bytes():
    x, records = _golden()
    planes = (Plane("latent", 1, 512), Plane("rope", 1, 64))
    layout = Layout("BNHC", 64, "u8", quant="fp8_ds_mla", planes="concat")
    got = encode(torch.from_numpy(x).reshape(3, 1, 576), layout, 0, planes)
    assert got.reshape(3, 656).numpy().tobytes() == b"".join(records)
    assert torch.equal(decode(got, layout, 0, planes), decode_records(got))


def test_dequantising_read_of_the_golden_records():
    x, records = _golden()
    stored = torch.frombuffer(bytearray(b"".join(records)), dtype=torch.uint8).reshape(3, 656)
    latent, rope = ds_mla_records_to_latent_rope(stored)
    assert latent.dtype == rope.dtype == torch.float32
    want = np.stack([_expected_latent(r) for r in records])
    assert np.array_equal(latent.numpy(), want) and np.array_equal(rope.numpy(), x[:, 512:])
    assert torch.equal(decode_records(stored), torch.cat([latent, rope], dim=-1))
    assert latent[1, 128:256].eq(0).all()  # the zero tile reads back as zeros, not NaN


@pytest.mark.parametrize("width", [640, 655, 657, 576])
def test_records_of_another_width_are_refused_naming_it(width):
    with pytest.raises(ShapeError, match=f"656 wide; got a last dimension of {width}"):
        ds_mla_records_to_latent_rope(torch.zeros(2, width, dtype=torch.uint8))


def test_records_must_be_bytes_and_values_576_wide():
    with pytest.raises(ShapeError, match="uint8"):
        ds_mla_records_to_latent_rope(torch.zeros(2, 656, dtype=torch.int8))
    with pytest.raises(ShapeError, match="576 wide; got a last dimension of 512"):
        encode_records(torch.zeros(2, 512))


def test_a_buffer_of_another_record_width_is_refused():
    model = ModelSpec((LayerSpec(MLA, latent_dim=512, rope_dim=64),))
    desc = preset_descriptor("vllm-fp8-ds-mla", model, block_size=4)
    with pytest.raises(ShapeError, match=r"\[2, 4, 1, 656\].*\[2, 4, 1, 640\]"):
        CacheBuffers(desc, {"0": torch.zeros(2, 4, 1, 640, dtype=torch.uint8)})


@pytest.mark.parametrize("latent_dim, rope_dim", [(448, 64), (512, 32), (576, 0)])
def test_other_mla_geometry_is_refused(latent_dim, rope_dim):
    model = ModelSpec((LayerSpec(MLA, latent_dim=latent_dim, rope_dim=rope_dim),))
    layout = Layout("BNHC", 64, "u8", quant="fp8_ds_mla", planes="concat")
    with pytest.raises(DescriptorError, match="kv_lora_rank 512 and rope 64"):
        Descriptor(model, layout)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("index", [5, 300, 560])
def test_non_finite_values_are_refused(bad, index):
    x = torch.from_numpy(golden_inputs()).reshape(-1)[:576].clone()  # token 0
    x[index] = bad
    with pytest.raises(CodecError, match=f"non-finite value at index \\[{index}\\]"):
        encode_records(x)


def test_a_layout_cannot_split_the_record():
    with pytest.raises(DescriptorError, match="C innermost, untiled"):
        Layout("BNHCc16", 64, "u8", quant="fp8_ds_mla", planes="concat")
