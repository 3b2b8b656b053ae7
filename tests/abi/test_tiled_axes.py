"""Tiled axes and per-plane orders (ABI 1.1): parsing, refusals, forms, golden vectors."""

import hashlib
import json

import pytest
import torch

from kvabi.abi.axes import AxisPart, dim_of, parse_axes, part_sizes, plain_letters
from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, MLA, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import DescriptorError
from kvabi.abi.text_form import from_text

TINY = ModelSpec((LayerSpec(ATTN, 1, 16, 16),), "tiny")
AMX_TINY = Layout("BHKNCn16c2", 32, "bf16", v_axes="BHKCNc16n2", name="vllm-cpu-amx")


def test_parse_splits_whole_axes_and_tiles():
    assert parse_axes("BHKNCn16c2") == (
        AxisPart("B"),
        AxisPart("H"),
        AxisPart("K"),
        AxisPart("N"),
        AxisPart("C"),
        AxisPart("N", 16),
        AxisPart("C", 2),
    )
    assert plain_letters("BHKCNc16n2") == "BHKCN"
    assert part_sizes("BHKNCn16c2", {"B": 3, "H": 2, "K": 2, "N": 128, "C": 64}) == (
        3,
        2,
        2,
        8,
        32,
        16,
        2,
    )
    assert dim_of("Cc4Bn2N", "B") == 2
    assert part_sizes("BNn4n2HC", {"B": 1, "N": 16, "H": 1, "C": 8}) == (1, 2, 4, 2, 1, 8)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Layout("BHNCn1", 16), "axes"),  # a tile of 1 splits nothing
        (lambda: Layout("BHNCn0", 16), "axes"),
        (lambda: Layout("BHNCn", 16), "axes"),  # a tile needs a size
        (lambda: Layout("BHNCb4", 16), "axes"),  # blocks are the extent: never tiled
        (lambda: Layout("THCt4", 0), "axes"),
        (lambda: Layout("BHNCk2", 16), "axes"),
        (lambda: Layout("BHCn4", 16), "axes"),  # N itself missing (only its tile)
        (lambda: Layout("BHNCn16", 24), "axes"),  # 16 does not divide 24
        (lambda: Layout("BHNCn4n8", 16), "axes"),  # 32 does not divide 16
        (lambda: Layout("BNHCc4", 16, planes="concat"), "axes"),
        (lambda: Layout("BNHCc4", 16, "int8", quant="per_token_head", planes="concat"), "axes"),
        (lambda: Layout("BHKNC", 16, v_axes="HBKNC"), "v_axes"),  # differs before K
        (lambda: Layout("BHKNC", 16, v_axes="BHNC"), "v_axes"),
        (lambda: Layout("BNHC", 16, planes="concat", v_axes="BHNC"), "v_axes"),
        (lambda: Descriptor(TINY, Layout("BHKNCc32", 16)), "axes"),  # 32 does not divide 16
        (lambda: Descriptor(TINY, Layout("BHKNCh2", 16)), "axes"),  # 2 heads of 1
        (lambda: Descriptor(TINY, Layout("BHKNC", 16, v_axes="BHKCNc3")), "v_axes"),
        (
            lambda: Descriptor(
                ModelSpec((LayerSpec(MLA, latent_dim=16, rope_dim=8),)),
                Layout("BNHCc16", 16, planes="separate"),
            ),
            "axes",
        ),
    ],
)
def test_impossible_tilings_are_refused_naming_the_field(build, field):
    with pytest.raises(DescriptorError, match=f"^{field}:"):
        build()


def test_version_is_the_lowest_that_has_the_features_used():
    assert Descriptor(TINY, Layout("BHKNC", 32)).version == (1, 0)
    assert Descriptor(TINY, Layout("BHKNCn16", 32)).version == (1, 1)
    assert Descriptor(TINY, Layout("BHKCN", 32, v_axes="BHKNC")).version == (1, 1)
    assert Descriptor(TINY, Layout("BHNC", 32, planes="separate", v_axes="BNHC")).version == (
        1,
        0,
    )


GOLDEN_JSON = (
    '{"kvabi":"1.1","layout":{"axes":"BHKNCn16c2","block_size":32,"dtype":"bf16",'
    '"name":"vllm-cpu-amx","planes":"axis","quant":"none","scales":[],"tp_rank":0,'
    '"tp_size":1,"v_axes":"BHKCNc16n2"},"model":{"fingerprint":"tiny","k_post_rope":true,'
    '"layers":[{"k_dim":16,"kind":"attn","num_kv_heads":1,"v_dim":16}],"rope_dim":0,'
    '"rope_pairing":"half"}}'
)
GOLDEN_TEXT = (
    "kvabi/1.1 layers=attn:1x16 fp=tiny rope=post:half axes=BHKNCn16c2 bs=32 dtype=bf16 "
    "v_axes=BHKCNc16n2 name=vllm-cpu-amx"
)


def test_text_and_json_golden_and_round_trip():
    desc = Descriptor(TINY, AMX_TINY)
    assert desc.to_json() == GOLDEN_JSON
    assert str(desc) == GOLDEN_TEXT
    assert Descriptor.from_json(GOLDEN_JSON) == desc
    assert from_text(GOLDEN_TEXT) == desc
    data = json.loads(GOLDEN_JSON)
    data["kvabi"] = "1.0"  # a 1.0 label cannot hide 1.1 features: read as 1.1
    assert Descriptor.from_dict(data).version == (1, 1)


@pytest.mark.parametrize(
    "axes, v_axes",
    [
        ("BHKNCn16c2", "BHKCNc16n2"),
        ("BHKCN", "BHKNC"),
        ("KBNHCc2", ""),
        ("BLKHNCh2n4", ""),
        ("Nn2n2BHKC", ""),
        ("BHKNCn4", "BHKn2NC"),
    ],
)
def test_forms_round_trip_for_tiled_layouts(axes, v_axes):
    model = ModelSpec((LayerSpec(ATTN, 2, 16, 16),) * 2, "m")
    desc = Descriptor(model, Layout(axes, 16, "f32", v_axes=v_axes))
    assert from_text(str(desc)) == desc
    assert Descriptor.from_json(desc.to_json()) == desc


# Golden element offsets of the tiny AMX tiling, slot o and dim d of one block and head
# (D = 16, bs = 32), from vLLM's packing: K at (o//16)*16*D + (d//2)*32 + (o%16)*2 + d%2,
# V at D*bs + (d//16)*bs*16 + (o//2)*32 + (d%16)*2 + o%2.
GOLDEN_OFFSETS = {("k", 0, 0): 0, ("k", 0, 1): 1, ("k", 1, 0): 2, ("k", 0, 2): 32}
GOLDEN_OFFSETS |= {("k", 17, 3): 256 + 32 + 2 + 1, ("v", 0, 0): 512, ("v", 1, 0): 513}
GOLDEN_OFFSETS |= {("v", 0, 1): 514, ("v", 2, 0): 544, ("v", 31, 15): 512 + 15 * 32 + 30 + 1}
# SHA-256 of the block's f32 bytes with k[o, d] = 16*o + d and v[o, d] = 512 + 16*o + d.
GOLDEN_BLOCK_SHA256 = "f30206dcf5564412bb47b0d4de8c52c4b6f4b9e67ea28f5fcd7ead08683da1c1"


def _amx_offset(plane: str, o: int, d: int, head_dim: int = 16, bs: int = 32) -> int:
    if plane == "k":
        return (o // 16) * 16 * head_dim + (d // 2) * 32 + (o % 16) * 2 + d % 2
    return head_dim * bs + (d // 16) * bs * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2


def _tiny_amx_cache(layout: Layout) -> CacheBuffers:
    """K/V of 32 tokens in canonical order, converted into `layout`."""
    k = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 1, 16)  # [T, H, D]
    src = CacheBuffers(
        Descriptor(TINY, Layout("THC", 0, "f32", planes="separate")),
        {"0.k": k, "0.v": k + 512},
    )
    return convert(src, Descriptor(TINY, layout), num_tokens=32)


def test_golden_element_offsets_of_the_amx_tiling():
    f32 = Layout("BHKNCn16c2", 32, "f32", v_axes="BHKCNc16n2")
    assert buffer_specs(Descriptor(TINY, f32), 1)[0].shape == (1, 1, 2, 512)
    flat = _tiny_amx_cache(f32).tensors["0"].reshape(-1)  # [2 * 32 * 16]
    for (plane, o, d), offset in GOLDEN_OFFSETS.items():
        assert offset == _amx_offset(plane, o, d)
        assert flat[offset].item() == 16 * o + d + (512 if plane == "v" else 0), (plane, o, d)
    for plane, base in (("k", 0), ("v", 512)):
        for o in range(32):
            for d in range(16):
                assert flat[_amx_offset(plane, o, d)].item() == base + 16 * o + d
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    assert digest == GOLDEN_BLOCK_SHA256


def test_tiled_views_round_trip_bit_exactly_through_every_path():
    cache = _tiny_amx_cache(AMX_TINY)
    hnd = Descriptor(TINY, Layout("KBHNC", 32, "bf16"))
    back = convert(convert(cache, hnd, num_tokens=32), Descriptor(TINY, AMX_TINY), num_tokens=32)
    assert torch.equal(back.tensors["0"], cache.tensors["0"])
    whole = convert(cache, hnd)  # whole-cache conversion takes the token path for tiles
    assert torch.equal(whole.tensors["0"][0, 0, 0, 17], torch.arange(272, 288).bfloat16())


def test_tiled_cache_round_trips_through_a_container(tmp_path):
    from kvabi.wire import read_container, write_container

    cache = _tiny_amx_cache(AMX_TINY)
    path = tmp_path / "amx.kvabi"
    write_container(path, cache, list(range(32)))
    back = read_container(path, expect=TINY)
    assert back.cache.desc == cache.desc and back.cache.desc.version == (1, 1)
    assert torch.equal(back.cache.tensors["0"], cache.tensors["0"])
