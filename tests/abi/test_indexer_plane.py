"""The DeepSeek V3.2 indexer plane (docs/ABI.md 2.1, 3.3, golden vector 6.6): the `dsa` layer
kind, its text and JSON forms, its sidecar buffer, vLLM's fp8 + f32-scale encoding, conversion.

Expected bytes are built without the encoder and without torch's fp8 cast: e4m3 codes from a
table of the 127 finite magnitudes (nearest, ties to the even code), scales as numpy float32
`max(amax, 1e-4) / 448` raised to a power of two by `math.frexp` (the exact ceil of log2),
packed with `struct.pack('<f')`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import struct

import numpy as np
import pytest
import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs, group_views
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import MLA, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import CodecError, DescriptorError, MissingPlaneError, ShapeError
from kvabi.abi.indexer_record import decode_blocks, encode_blocks, encode_tokens, record_bytes
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.abi.text_form import from_text

DSA = LayerSpec(MLA, latent_dim=512, rope_dim=64, indexer_dim=128)
V32 = ModelSpec((DSA,), fingerprint="dsv32")
GOLDEN_TEXT = (
    "kvabi/1.3 layers=dsa:512+64+128 fp=dsv32 rope=post:half axes=BNHC bs=64 dtype=u8 "
    "quant=fp8_ds_mla planes=concat name=vllm-fp8-ds-mla"
)
GOLDEN_JSON = (
    '{"kvabi":"1.3","layout":{"axes":"BNHC","block_size":64,"dtype":"u8",'
    '"name":"vllm-fp8-ds-mla","planes":"concat","quant":"fp8_ds_mla","scales":[],"tp_rank":0,'
    '"tp_size":1,"v_axes":""},"model":{"fingerprint":"dsv32","k_post_rope":true,"layers":'
    '[{"indexer_dim":128,"kind":"dsa","latent_dim":512,"rope_dim":64}],"rope_dim":0,'
    '"rope_pairing":"half"}}'
)
GOLDEN_DIGEST = "dd851d2fdcb423c037113cb1dac2387b"
GOLDEN_RECORD_SHA256 = [  # pinned once from the hand-built records; also in docs/ABI.md 6.6
    "54d153645a444eafa07370662b71e69e2a539c76189e809f1960983f12871640",
    "705a69a2baea4236a756962186e8e0ba9b8d03bb5655fbd4e1dc57238b8054e1",
    "567f7bd7ac45be508b17fec835709d5f3f44bc27e7cf04d5b487dad9a5612c50",
]
GOLDEN_SCALE_HEX = ["0000003d", "00008034", "00008034"]  # 2^-5, 2^-22, 2^-22
E4M3 = [c * 2.0**-9 if c < 8 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]


def golden_keys() -> np.ndarray:
    """Three indexer keys of 128 values (docs/ABI.md 6.6)."""
    t0 = [((37 * j) % 255 - 127) / 16 for j in range(128)]  # amax 127/16: scale 2^-5, ties
    t0[5] = -0.0
    t1 = [0.0] * 128  # amax 0 < 1e-4: the floor, scale 2^-22, codes 0
    t2 = [(j - 64) * 2.0**-20 for j in range(128)]  # amax 2^-14 < 1e-4: scale 2^-22 too
    return np.array([t0, t1, t2], dtype=np.float32)


def _e4m3_byte(x: float) -> int:
    a = min(abs(x), 448.0)
    c = bisect.bisect_left(E4M3, a)
    if c > 0:
        below, above = a - E4M3[c - 1], E4M3[c] - a
        if below < above or (below == above and (c - 1) % 2 == 0):
            c -= 1
    return c | (0x80 if np.signbit(x) else 0)


def _scale(key: np.ndarray) -> np.float32:
    raw = max(np.abs(key).max(), np.float32(1e-4)) / np.float32(448)
    mantissa, exponent = math.frexp(float(raw))
    return np.float32(2.0 ** (exponent - 1 if mantissa == 0.5 else exponent))


def _record(key: np.ndarray) -> bytes:
    """One token's 132 bytes: 128 e4m3 codes, then the f32 scale."""
    scale = _scale(key)
    return bytes(_e4m3_byte(float(x / scale)) for x in key) + struct.pack("<f", scale)


def test_descriptor_text_and_json_are_the_golden_ones():
    desc = preset_descriptor("vllm-fp8-ds-mla", V32)
    assert desc.version == (1, 3)
    assert str(desc) == GOLDEN_TEXT and desc.to_json() == GOLDEN_JSON
    assert from_text(GOLDEN_TEXT) == desc and Descriptor.from_json(GOLDEN_JSON) == desc
    assert desc.model.compat_digest() == GOLDEN_DIGEST
    assert (
        desc.model.compat_digest()
        != ModelSpec((LayerSpec(MLA, 0, 0, 0, 512, 64),), "dsv32").compat_digest()
    )


def test_an_older_reader_refuses_a_dsa_layer():
    """A 1.2 reader keeps the fields it knows (so drops `indexer_dim`) and meets kind `dsa`:
    an unknown layer kind, refused, never read as MLA without the indexer."""
    old_fields = set(LayerSpec.__dataclass_fields__) - {"indexer_dim"}
    entry = {"indexer_dim": 128, "kind": "dsa", "latent_dim": 512, "rope_dim": 64}
    with pytest.raises(DescriptorError, match="unknown layer kind 'dsa'"):
        LayerSpec(**{k: v for k, v in entry.items() if k in old_fields})


@pytest.mark.parametrize(
    "bad",
    [
        '{"indexer_dim":128,"kind":"mla","latent_dim":512,"rope_dim":64}',  # bare field on mla
        '{"kind":"dsa","latent_dim":512,"rope_dim":64}',  # dsa without its width
        '{"indexer_dim":0,"kind":"dsa","latent_dim":512,"rope_dim":64}',
    ],
)
def test_malformed_indexer_layers_are_refused(bad):
    text = GOLDEN_JSON.replace(
        '{"indexer_dim":128,"kind":"dsa","latent_dim":512,"rope_dim":64}', bad
    )
    with pytest.raises(DescriptorError, match="indexer_dim"):
        Descriptor.from_json(text)


def test_indexer_only_on_mla_and_never_cross_layer():
    with pytest.raises(DescriptorError, match="indexer_dim"):
        LayerSpec("attn", 1, 8, 8, indexer_dim=8)
    with pytest.raises(DescriptorError, match="indexer_dim"):
        LayerSpec(MLA, latent_dim=8, rope_dim=4, indexer_dim=-1)
    with pytest.raises(DescriptorError, match="cannot read layer"):
        from_text(GOLDEN_TEXT.replace("dsa:512+64+128", "dsa:512+64+0"))
    model = ModelSpec((LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=8),) * 2, "x")
    with pytest.raises(DescriptorError, match="per-layer layout"):
        Descriptor(model, Layout(axes="LBNHC", block_size=4, dtype="bf16", planes="concat"))


def test_the_indexer_has_a_buffer_of_its_own_after_the_layers_kv():
    desc = preset_descriptor("vllm-fp8-ds-mla", ModelSpec((DSA, DSA), "dsv32"))
    specs = buffer_specs(desc, 3)
    assert [(s.key, s.planes, s.shape) for s in specs] == [
        ("0", ("latent", "rope"), (3, 64, 1, 656)),
        ("0.indexer", ("indexer",), (3, 64 * 132)),
        ("1", ("latent", "rope"), (3, 64, 1, 656)),
        ("1.indexer", ("indexer",), (3, 64 * 132)),
    ]
    assert all(s.dtype == torch.uint8 for s in specs[1::2])
    unpaged = Descriptor(V32, Layout(axes="THC", block_size=0, dtype="bf16", planes="separate"))
    assert [(s.key, s.shape) for s in buffer_specs(unpaged, 5)] == [
        ("0.latent", (5, 1, 512)),
        ("0.rope", (5, 1, 64)),
        ("0.indexer", (5, 132)),
    ]
    cache = CacheBuffers.empty(desc, 1)
    assert [planes for planes, _ in group_views(desc, cache.tensors, 0)] == [
        desc.model.layers[0].planes
    ]


def test_hand_built_records_match_the_pins():
    records = [_record(k) for k in golden_keys()]
    assert [len(r) for r in records] == [132] * 3
    assert [r[128:].hex() for r in records] == GOLDEN_SCALE_HEX
    assert [hashlib.sha256(r).hexdigest() for r in records] == GOLDEN_RECORD_SHA256
    # -254 -> 256 (0x78), ..., -0.0 -> 0x80
    assert records[0][:8].hex() == "f8f3ede0628074f7"


def test_encoder_writes_the_golden_records_and_vllms_block_layout():
    keys = golden_keys()
    records = [_record(k) for k in keys]
    unpaged = encode_blocks(torch.from_numpy(keys), block_size=1)  # [3, 132]: one record each
    assert [bytes(r.numpy()) for r in unpaged] == records
    paged = encode_blocks(torch.from_numpy(keys), block_size=2)  # [2, 264]
    codes = [r[:128] for r in records]
    scales = [r[128:] for r in records]
    assert bytes(paged[0].numpy()) == codes[0] + codes[1] + scales[0] + scales[1]
    assert bytes(paged[1].numpy()) == codes[2] + bytes(128) + scales[2] + bytes(4)


def test_encoder_matches_the_hand_built_records_on_random_bf16_keys():
    keys = (torch.randn(16, 128, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    keys = keys.float()
    got = encode_blocks(keys, block_size=1)
    assert [bytes(r.numpy()) for r in got] == [_record(k) for k in keys.numpy()]


def test_decode_is_code_times_scale_within_the_e4m3_bound():
    keys = torch.randn(10, 64, generator=torch.Generator().manual_seed(5))
    blocks = encode_blocks(keys, block_size=4)
    got = decode_blocks(blocks, 64)[:10]
    codes, scales = encode_tokens(keys)
    assert torch.equal(got, codes.view(torch.float8_e4m3fn).float() * scales[:, None])
    assert ((got - keys).abs() <= keys.abs() * 2**-4 + scales[:, None] * 2**-9).all()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_keys_are_refused(bad):
    keys = torch.zeros(2, 8)
    keys[1, 3] = bad
    with pytest.raises(CodecError, match=r"\[1, 3\]"):
        encode_tokens(keys)
    with pytest.raises(ShapeError):
        decode_blocks(torch.zeros(2, 13, dtype=torch.uint8), 8)
    assert record_bytes(128) == 132


def _v32_cache(desc: Descriptor, extent: int, seed: int = 0) -> CacheBuffers:
    g = torch.Generator().manual_seed(seed)
    cache = CacheBuffers.empty(desc, extent)
    for s in buffer_specs(desc, extent):
        if s.dtype == torch.uint8:
            cache.tensors[s.key].copy_(torch.randint(0, 127, s.shape, generator=g))
        else:
            cache.tensors[s.key].copy_(torch.randn(s.shape, generator=g))
    return cache


def test_conversion_moves_the_indexer_bytes_and_reblocks_them():
    model = ModelSpec((LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=8),) * 2, "tiny")
    src_desc = preset_descriptor("vllm-mla", model, block_size=4, dtype="f32")
    src = _v32_cache(src_desc, 3)
    tokens = encode_blocks(torch.randn(12, 8), block_size=4)  # real records: 12 tokens
    for i in range(2):
        src.tensors[f"{i}.indexer"].copy_(tokens)
    whole = convert(src, src_desc.with_layout(dtype="bf16"))
    assert torch.equal(whole.tensors["1.indexer"], tokens)
    reblocked = convert(
        src,
        src_desc.with_layout(block_size=2),
        num_tokens=7,
        src_block_ids=[2, 0],
        dst_block_ids=[3, 1, 0, 4],
    )
    # tokens 0..6 are the source's blocks 2 and 0, the destination's blocks 3, 1, 0, 4
    src_tokens = [decode_blocks(tokens, 8)[b * 4 + t] for b in (2, 0) for t in range(4)][:7]
    got = decode_blocks(reblocked.tensors["0.indexer"], 8)
    dst_rows = [b * 2 + t for b in (3, 1, 0, 4) for t in range(2)][:7]
    assert all(torch.equal(got[r], s) for r, s in zip(dst_rows, src_tokens, strict=True))
    unpaged = Descriptor(model, Layout(axes="THC", block_size=0, dtype="f32", planes="separate"))
    flat = convert(src, unpaged, num_tokens=12)
    assert torch.equal(decode_blocks(flat.tensors["0.indexer"], 8), decode_blocks(tokens, 8))


def test_a_cache_without_its_indexer_buffer_is_refused_naming_the_plane():
    desc = preset_descriptor(
        "vllm-mla", ModelSpec((LayerSpec(MLA, 0, 0, 0, 16, 8, indexer_dim=8),), "t")
    )
    tensors = dict(CacheBuffers.empty(desc, 2).tensors)
    del tensors["0.indexer"]
    with pytest.raises(MissingPlaneError, match="layer 0 lacks its 'indexer' plane") as info:
        CacheBuffers(desc, tensors)
    assert (info.value.layer_id, info.value.plane) == (0, "indexer")


MLA_PRESETS = sorted(  # paged ones: the pair test moves blocks through block tables
    name
    for name, p in PRESETS.items()
    if p.kind == MLA and not p.layout.is_cross_layer and p.layout.is_paged
)


def test_cross_layer_mla_presets_refuse_the_indexer():
    """TRT-LLM's one pool of every layer (an L axis) has no per-layer sidecar buffer: refused."""
    cross = sorted(n for n, p in PRESETS.items() if p.kind == MLA and p.layout.is_cross_layer)
    assert cross == ["trtllm-mla"]
    with pytest.raises(DescriptorError, match="per-layer layout"):
        preset_descriptor("trtllm-mla", V32)


@pytest.mark.parametrize("dst_name", MLA_PRESETS)
@pytest.mark.parametrize("src_name", MLA_PRESETS)
def test_every_mla_preset_pair_carries_the_indexer_byte_for_byte(src_name, dst_name):
    """A V3.2 cache (512 + 64 + 128, so fp8_ds_mla applies) converted between every pair of
    MLA presets, each with its own block size and a shuffled block table: each token's 132
    indexer bytes arrive unchanged, whatever the latents' codec does."""
    src_desc = preset_descriptor(src_name, V32, block_size=4)
    dst_desc = preset_descriptor(dst_name, V32, block_size=2)
    src = CacheBuffers.empty(src_desc, 3, "zeros")
    keys = torch.randn(10, 128, generator=torch.Generator().manual_seed(7))
    src.tensors["0.indexer"][[2, 0, 1]] = encode_blocks(keys, 4)  # tokens' blocks: 2, 0, 1
    out = convert(
        src, dst_desc, num_tokens=10, src_block_ids=[2, 0, 1], dst_block_ids=[4, 0, 3, 1, 2]
    )
    got = out.tensors["0.indexer"][[4, 0, 3, 1, 2]]
    assert torch.equal(got, encode_blocks(keys, 2))


def test_an_unpaged_mla_layout_carries_the_indexer_per_token():
    """Paged -> unpaged (`hf-dynamic-mla`, HF's latent cache, a T axis): the sidecar becomes one
    132-byte record per token, the same bytes as a one-token-per-block encoding."""
    src = CacheBuffers.empty(preset_descriptor("vllm-mla", V32, block_size=4), 3, "zeros")
    keys = torch.randn(10, 128, generator=torch.Generator().manual_seed(7))
    src.tensors["0.indexer"][[2, 0, 1]] = encode_blocks(keys, 4)
    dst = preset_descriptor("hf-dynamic-mla", V32)
    out = convert(src, dst, num_tokens=10, src_block_ids=[2, 0, 1])
    assert torch.equal(out.tensors["0.indexer"], encode_blocks(keys, 1).reshape(10, 132))
