"""ABI 1.2: windowed, shared and KV-less layers in the descriptor, and the groups they form."""

import json

import pytest

from kvabi.abi.descriptor import ATTN, NONE, SHARED, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import DescriptorError
from kvabi.abi.kv_groups import KVGroup, kv_groups, layer_groups
from kvabi.abi.text_form import from_text

SLIDING = LayerSpec(ATTN, 1, 256, 256, window=512)
FULL = LayerSpec(ATTN, 1, 256, 256)
# Gemma 3 270M: 18 layers, every 6th full attention, the rest a 512-token window.
GEMMA3 = ModelSpec(tuple(FULL if i % 6 == 5 else SLIDING for i in range(18)), "gemma3-270m")


def test_gemma3_groups_and_golden_forms():
    assert kv_groups(GEMMA3) == (
        KVGroup(0, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16), SLIDING),
        KVGroup(1, (5, 11, 17), FULL),
    )
    desc = Descriptor(GEMMA3, Layout("BKNHC", 16, "bf16"))
    assert desc.version == (1, 2)
    assert str(desc) == (
        "kvabi/1.2 layers=5*swa512:1x256,attn:1x256,5*swa512:1x256,attn:1x256,"
        "5*swa512:1x256,attn:1x256 fp=gemma3-270m rope=post:half axes=BKNHC bs=16 dtype=bf16"
    )
    layers = json.loads(desc.to_json())["model"]["layers"]
    assert layers[0] == {
        "k_dim": 256,
        "kind": "swa",
        "num_kv_heads": 1,
        "v_dim": 256,
        "window": 512,
    }
    assert layers[5] == {"k_dim": 256, "kind": "attn", "num_kv_heads": 1, "v_dim": 256}
    # Golden (docs/ABI.md 6.4): the window enters the compatibility digest.
    assert GEMMA3.compat_digest() == GEMMA3_DIGEST
    assert ModelSpec((FULL,) * 18, "gemma3-270m").compat_digest() != GEMMA3_DIGEST


GEMMA3_DIGEST = "b47e2d916815e7615f23957aedf594f8"  # sha256 of the JSON by hand


def test_shared_and_kvless_layers_take_no_group_and_read_their_target():
    layers = (
        FULL,
        SLIDING,
        LayerSpec(NONE),
        LayerSpec(SHARED, shares=1, window=512),
        LayerSpec(SHARED, shares=0),
        LayerSpec(ATTN, 2, 512, 512),
    )
    model = ModelSpec(layers)
    assert kv_groups(model) == (
        KVGroup(0, (0,), FULL, reader_ids=(4,)),
        KVGroup(1, (1,), SLIDING, reader_ids=(3,)),
        KVGroup(2, (5,), LayerSpec(ATTN, 2, 512, 512)),
    )
    assert layer_groups(model) == (0, 1, -1, 1, 0, 2)
    text = str(Descriptor(model, Layout("BNHC", 4, "f32", planes="separate")))
    assert "layers=attn:1x256,swa512:1x256,none,shared@1:swa512,shared@0,attn:2x512 " in text
    assert from_text(text).model == model


def test_uniform_descriptors_keep_their_10_forms():
    # No window, no KV-less layer: the JSON and the label are 1.0's, byte for byte.
    desc = Descriptor(ModelSpec((FULL,) * 2, "x"), Layout("BKNHC", 16, "bf16"))
    assert desc.version == (1, 0) and '"window"' not in desc.to_json()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ModelSpec((FULL, LayerSpec(SHARED, shares=2), FULL)), "not an earlier layer"),
        (lambda: ModelSpec((FULL, LayerSpec(SHARED, shares=1))), "not an earlier layer"),
        (
            lambda: ModelSpec((LayerSpec(NONE), LayerSpec(SHARED, shares=0))),
            "not an earlier layer",
        ),
        (lambda: ModelSpec((SLIDING, LayerSpec(SHARED, shares=0))), "of another kind"),
        (lambda: ModelSpec((FULL, LayerSpec(SHARED, shares=0, window=512))), "of another kind"),
    ],
)
def test_bad_shares_are_refused_naming_the_problem(build, message):
    with pytest.raises(DescriptorError, match=f"^shares: .*{message}"):
        build()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (2, "layer 2 shares layer 2, which is not an earlier layer"),  # itself
        (3, "layer 2 shares layer 3, which is not an earlier layer"),  # forward
        (1, "layer 2 \\(window 0\\) shares layer 1 of another kind \\(window 512\\)"),
    ],
)
def test_bad_shares_are_refused_when_read(target, message):
    """The same checks on the text and JSON forms a reader gets from a file or a peer."""
    model = ModelSpec((FULL, SLIDING, LayerSpec(SHARED, shares=0), FULL))
    desc = Descriptor(model, Layout("BKNHC", 16, "bf16"))
    text = str(desc).replace("shared@0", f"shared@{target}")
    data = json.loads(desc.to_json())
    data["model"]["layers"][2]["shares"] = target
    with pytest.raises(DescriptorError, match=f"^shares: {message}"):
        from_text(text)
    with pytest.raises(DescriptorError, match=f"^shares: {message}"):
        Descriptor.from_dict(data)


def test_bad_windows_are_refused():
    with pytest.raises(DescriptorError, match="^window:"):
        LayerSpec(ATTN, 1, 8, 8, window=-1)
    with pytest.raises(DescriptorError, match="^window:"):
        LayerSpec("mla", latent_dim=512, rope_dim=64, window=128)
    data = json.loads(Descriptor(GEMMA3, Layout("BKNHC", 16)).to_json())
    data["model"]["layers"][5]["window"] = 512  # an attn layer claiming a window
    with pytest.raises(DescriptorError, match="^window:"):
        Descriptor.from_dict(data)
    del data["model"]["layers"][0]["window"]  # a swa layer without one
    with pytest.raises(DescriptorError, match="^window:"):
        Descriptor.from_dict(data)


def test_a_reader_that_does_not_know_swa_refuses_it():
    # A 1.0/1.1 reader ignores fields it does not know, so a window alone would be read as
    # full attention; the kind `swa` is what it refuses. Simulated: 1.1's kind check.
    data = json.loads(Descriptor(GEMMA3, Layout("BKNHC", 16)).to_json())
    kinds = {x["kind"] for x in data["model"]["layers"]}
    assert kinds - {"attn", "mla", "shared"} == {"swa"}
