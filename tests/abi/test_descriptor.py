import json

import pytest
from hypothesis import given, settings

from kvabi.abi.descriptor import (
    ATTN,
    MLA,
    SHARED,
    Descriptor,
    LayerSpec,
    Layout,
    ModelSpec,
)
from kvabi.abi.errors import DescriptorError
from kvabi.abi.text_form import from_text
from tests.abi.strategies import descriptors

GQA = ModelSpec((LayerSpec(ATTN, 8, 128, 128),) * 2, fingerprint="llama")


@settings(max_examples=200, deadline=None)
@given(descriptors())
def test_text_and_json_forms_round_trip(desc):
    assert from_text(str(desc)) == desc
    assert Descriptor.from_json(desc.to_json()) == desc


def test_text_form_golden():
    desc = Descriptor(GQA, Layout("KBNHC", 16, "bf16", tp_rank=1, tp_size=2))
    assert str(desc) == (
        "kvabi/1.0 layers=2*attn:8x128 fp=llama rope=post:half axes=KBNHC bs=16 dtype=bf16 tp=1/2"
    )
    mixed = ModelSpec(
        (
            LayerSpec(ATTN, 2, 64, 32),
            LayerSpec(SHARED, shares=0),
            LayerSpec(MLA, latent_dim=512, rope_dim=64),
        ),
        "a b",
    )
    text = str(Descriptor(mixed, Layout("BNHC", 4, "f32", planes="separate")))
    assert "layers=attn:2x64/32,shared@0,mla:512+64 fp=a%20b" in text


def test_json_is_canonical_and_ignores_unknown_fields_of_known_major():
    desc = Descriptor(GQA, Layout("BKNHC", 16, "bf16"))
    data = json.loads(desc.to_json())
    assert list(data) == sorted(data)
    data["layout"]["future_field"] = 7
    data["kvabi"] = "1.9"
    parsed = Descriptor.from_dict(data)
    assert parsed.layout == desc.layout and parsed.version == (1, 9)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Layout("KBNHC", 0, "bf16"), "block_size"),
        (lambda: Layout("KBNHC", -4, "bf16"), "block_size"),
        (lambda: Layout("KBNXC", 16, "bf16"), "axes"),
        (lambda: Layout("KBNHC", 16, "bf17"), "dtype"),
        (lambda: Layout("BNHC", 16, "bf16"), "planes"),
        (lambda: Layout("KBNHC", 16, "bf16", tp_rank=2, tp_size=2), "tp_rank"),
        (lambda: Layout("KBNHC", 16, "bf16", quant="per_tensor"), "dtype"),
        (lambda: Descriptor(GQA, Layout("KBNHC", 16, "bf16", tp_size=3)), "tp_size"),
        (
            lambda: Descriptor(
                ModelSpec((LayerSpec(MLA, latent_dim=448, rope_dim=64),)),
                Layout("BNHC", 64, "u8", quant="fp8_ds_mla", planes="concat"),
            ),
            "quant",
        ),
        (lambda: Descriptor(ModelSpec((LayerSpec(ATTN, 2, 64, 32),)), Layout("KBNHC", 4)), "axes"),
        (lambda: LayerSpec(ATTN, 0, 64, 64), "num_kv_heads"),
        (lambda: ModelSpec((LayerSpec(SHARED, shares=0),)), "shares"),
        (lambda: ModelSpec((LayerSpec(ATTN, 2, 64, 64),), rope_dim=65), "rope_dim"),
        (
            lambda: Descriptor(
                ModelSpec((LayerSpec(ATTN, 2, 64, 64), LayerSpec(ATTN, 4, 64, 64))),
                Layout("LKBNHC", 16),
            ),
            "axes",
        ),
    ],
)
def test_impossible_geometry_is_refused_naming_the_field(build, field):
    with pytest.raises(DescriptorError, match=f"^{field}:"):
        build()


def test_unknown_major_version_is_refused():
    data = json.loads(Descriptor(GQA, Layout("KBNHC", 16)).to_json())
    data["kvabi"] = "2.0"
    with pytest.raises(DescriptorError, match="major version 2"):
        Descriptor.from_dict(data)
    with pytest.raises(DescriptorError, match="major version 3"):
        from_text("kvabi/3.0 layers=attn:1x8 fp= rope=post:half axes=KBNHC bs=1 dtype=f32")


def test_compat_digest_ignores_layout_and_pairing_but_not_the_model():
    pairs = ModelSpec(GQA.layers, "llama", rope_pairing="pairs")
    assert GQA.compat_digest() == pairs.compat_digest()
    assert GQA.compat_digest() != ModelSpec(GQA.layers, "other").compat_digest()
    # Golden: SHA-256 of the canonical JSON of the model part (docs/ABI.md section 2), 16 bytes.
    assert GQA.compat_digest() == "0273b6b1e5590f4c68ab2e1a6b4ed70a"
