"""The descriptor's JSON as docs/ABI.md 1 and 2.1 state it: the version label a writer puts,
the JSON type of every value, the defaults of absent fields, and V orders of K's axes only."""

import json

import pytest

from kvabi.abi.descriptor import ATTN, MLA, NONE, SHARED, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import DescriptorError
from kvabi.abi.json_values import LAYER_FIELD_TYPES, LAYOUT_FIELD_TYPES

PLAIN = (
    '{"kvabi":"%s","layout":{"axes":"KBNHC","block_size":4,"dtype":"f16","name":"",'
    '"planes":"axis","quant":"none","scales":[],"tp_rank":0,"tp_size":1,"v_axes":""},'
    '"model":{"fingerprint":"tiny","k_post_rope":true,"layers":[{"k_dim":8,"kind":"attn",'
    '"num_kv_heads":1,"v_dim":8}],"rope_dim":0,"rope_pairing":"half"}}'
)
ATTN_1X8 = {"k_dim": 8, "kind": "attn", "num_kv_heads": 1, "v_dim": 8}


def _with(label: str, layers: list[dict] | None = None, **layout: object) -> str:
    data = json.loads(PLAIN % label)
    data["model"]["layers"] = layers or data["model"]["layers"]
    data["layout"] |= layout
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("label", ["1.0", "1.1", "1.2", "1.3"])
def test_a_plain_descriptor_is_written_back_with_its_label(label):
    """The label read is kept (never lowered); a plain descriptor made in code is 1.0."""
    assert Descriptor.from_json(PLAIN % label).to_json() == PLAIN % label
    made = Descriptor(ModelSpec((LayerSpec(ATTN, 1, 8, 8),), "tiny"), Layout("KBNHC", 4, "f16"))
    assert made.to_json() == PLAIN % "1.0"


SWA_3 = {**ATTN_1X8, "kind": "swa", "window": 3}
FEATURES = [  # (what, layers, layout changes, the version that introduced it)
    ("N tiles", None, {"axes": "KBNHCn2"}, "1.1"),
    ("plane orders", None, {"axes": "KBHNC", "v_axes": "KBHCN"}, "1.1"),
    ("swa", [SWA_3], {}, "1.2"),
    ("none", [ATTN_1X8, {"kind": "none"}], {}, "1.2"),
    ("shared window", [SWA_3, {"kind": "shared", "shares": 0, "window": 3}], {}, "1.2"),
    (
        "dsa",
        [{"indexer_dim": 128, "kind": "dsa", "latent_dim": 512, "rope_dim": 64}],
        {"axes": "BNHC", "dtype": "u8", "planes": "concat", "quant": "fp8_ds_mla"},
        "1.3",
    ),
]


@pytest.mark.parametrize(("what", "layers", "layout", "version"), FEATURES)
def test_each_feature_raises_the_label_to_the_version_that_introduced_it(
    what, layers, layout, version
):
    for label in ("1.0", "1.1"):
        expected = _with(max(label, version), layers, **layout)
        assert Descriptor.from_json(_with(label, layers, **layout)).to_json() == expected, what


NOT_INTEGERS = [True, False, 4.0, 1e0, "4", None, [4]]


@pytest.mark.parametrize("bad", NOT_INTEGERS)
@pytest.mark.parametrize(
    "where", ["num_kv_heads", "k_dim", "v_dim", "block_size", "tp_rank", "tp_size", "rope_dim"]
)
def test_only_json_integers_are_integers(where, bad):
    data = json.loads(PLAIN % "1.0")
    part = data["layout"] if where in LAYOUT_FIELD_TYPES else data["model"]["layers"][0]
    part = data["model"] if where == "rope_dim" else part
    part[where] = bad
    with pytest.raises(DescriptorError, match=where):
        Descriptor.from_dict(data)


@pytest.mark.parametrize(
    ("layer", "name"),
    [
        ({"kind": "mla", "latent_dim": 512.0, "rope_dim": 64}, "latent_dim"),
        ({"kind": "mla", "latent_dim": 512, "rope_dim": True}, "rope_dim"),
        ({"kind": "dsa", "latent_dim": 512, "rope_dim": 64, "indexer_dim": 128.0}, "indexer_dim"),
        ({**SWA_3, "window": 3.0}, "window"),
        ({"kind": "shared", "shares": True}, "shares"),
        ({**ATTN_1X8, "kind": 1}, "kind"),
    ],
)
def test_every_layer_integer_and_the_kind_have_their_json_type(layer, name):
    layers = [ATTN_1X8, layer] if layer["kind"] == "shared" else [layer]
    with pytest.raises(DescriptorError, match=name):
        Descriptor.from_json(_with("1.3", layers))


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("kvabi",), 1.0),
        (("model", "fingerprint"), 7),
        (("model", "k_post_rope"), "false"),
        (("model", "k_post_rope"), 1),
        (("model", "rope_pairing"), None),
        (("model", "layers"), {"0": ATTN_1X8}),
        (("layout", "axes"), ["K", "B"]),
        (("layout", "scales"), [True, 1.0]),
        (("layout", "scales"), ["1.0", 1.0]),
        (("layout", "name"), 0),
        (("layout",), []),
    ],
)
def test_strings_booleans_lists_and_objects_have_their_json_type(path, bad):
    root = json.loads(PLAIN % "1.0")
    *outer, last = path
    part = root
    for key in outer:
        part = part[key]
    part[last] = bad
    with pytest.raises(DescriptorError):
        Descriptor.from_dict(root)


def test_a_per_tensor_scale_may_be_a_json_integer():
    text = _with("1.0", None, dtype="fp8_e4m3", quant="per_tensor", scales=[1, 0.5])
    assert Descriptor.from_json(text).layout.scales == (1.0, 0.5)


def test_the_json_type_tables_name_every_field():
    assert set(LAYOUT_FIELD_TYPES) == set(Layout.__dataclass_fields__)
    assert set(LAYER_FIELD_TYPES) == set(LayerSpec.__dataclass_fields__)


def test_absent_optional_fields_take_their_defaults():
    """docs/ABI.md 2.1: in `layout` only `axes` is required; in a layer only what its kind
    needs (`kind` defaults to attn); every model field is required."""
    data = json.loads(PLAIN % "1.0")
    data["layout"] = {"axes": "KTHC"}
    data["model"]["layers"] = [
        {"num_kv_heads": 1, "k_dim": 8, "v_dim": 8},
        {"kind": "shared", "shares": 0},
        {"kind": "mla", "latent_dim": 16},
        {"kind": "none"},
    ]
    desc = Descriptor.from_dict(data)
    assert desc.layout == Layout("KTHC", 0, "bf16", "none", "axis", "", 0, 1, (), "")
    assert desc.model.layers == (
        LayerSpec(ATTN, 1, 8, 8),
        LayerSpec(SHARED, shares=0),
        LayerSpec(MLA, latent_dim=16, rope_dim=0),
        LayerSpec(NONE),
    )
    for key in ("layers", "fingerprint", "k_post_rope", "rope_pairing", "rope_dim"):
        data = json.loads(PLAIN % "1.0")
        del data["model"][key]
        with pytest.raises(DescriptorError, match=key):
            Descriptor.from_dict(data)


@pytest.mark.parametrize(
    ("axes", "v_axes", "planes"),
    [
        ("BNHC", "THC", "separate"),  # an unpaged order for a paged layout's V
        ("THC", "BNHC", "separate"),
        ("BNHC", "BNHCK", "separate"),  # a K axis in V alone
        ("BNHC", "BNH", "separate"),
        ("BKNHC", "BKNH", "axis"),
    ],
)
def test_v_axes_with_other_letters_than_axes_are_refused_at_parse_time(axes, v_axes, planes):
    layout = {"axes": axes, "v_axes": v_axes, "planes": planes}
    layout["block_size"] = 0 if axes == "THC" else 4
    with pytest.raises(DescriptorError, match="v_axes"):
        Descriptor.from_json(_with("1.0", None, **layout))
