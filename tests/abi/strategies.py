"""Hypothesis strategies for random (valid) model specs and layouts."""

from hypothesis import strategies as st

from kvabi.abi.descriptor import ATTN, MLA, NONE, SHARED, Descriptor, LayerSpec, Layout, ModelSpec

PAGED_AXES = ["KBNHC", "KBHNC", "BKNHC", "BKHNC", "BNHKC", "BHNKC", "HKBNC", "BNKHC"]
CROSS_AXES = ["BLKNHC", "BHLKNC", "BKHLNC", "BLHNKC", "LKBNHC"]
# ABI 1.1: tiled axes and per-plane orders after K (N tiles divide block sizes 4 and 16,
# C tiles divide every width the models below draw)
TILED_AXES = [
    ("BHKNCn4c2", "BHKCNc2n4"),
    ("BHKCN", "BHKNC"),
    ("KBNHCc4", ""),
    ("Nn2BKHCc2c2", ""),
    ("BHKNCn2", "BHKn4NCc8"),
]


@st.composite
def attn_models(draw, max_layers: int = 3, uniform: bool = False) -> ModelSpec:
    n = draw(st.integers(1, max_layers))
    dims = st.sampled_from([8, 16, 32])
    heads = st.sampled_from([1, 2, 4])
    d0 = draw(dims)
    first = LayerSpec(ATTN, draw(heads), d0, d0)
    layers = []
    for i in range(n):
        if uniform or i == 0:
            k = first.k_dim
            layer = LayerSpec(ATTN, first.num_kv_heads, k, k)
        elif draw(st.booleans()) and i > 0:
            target = draw(st.integers(0, i - 1)).__index__()
            if layers[target].has_kv:
                layer = LayerSpec(SHARED, shares=target, window=layers[target].window)
            else:
                layer = layers[0]
        elif draw(st.integers(0, 5)) == 0:
            layer = LayerSpec(NONE)  # a layer without KV (ABI 1.2)
        else:
            k = draw(dims)
            window = draw(st.sampled_from([0, 0, 4, 512]))  # sliding layers (ABI 1.2)
            layer = LayerSpec(ATTN, draw(heads), k, k, window=window)
        layers.append(layer)
    pairing = draw(st.sampled_from(["half", "pairs"]))
    return ModelSpec(tuple(layers), fingerprint=draw(st.text(max_size=8)), rope_pairing=pairing)


@st.composite
def attn_layouts(draw, model: ModelSpec) -> Layout:
    uniform = len({x for x in model.layers if x.has_kv}) == 1
    kinds = ["paged", "unpaged", "separate", "tiled"] + (["cross"] if uniform else [])
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(["f32", "bf16", "f16"]))
    if kind == "unpaged":
        return Layout(
            "THC", 0, dtype, planes="separate", v_axes=draw(st.sampled_from(["", "HCT", "TCH"]))
        )
    if kind == "tiled":
        axes, v_axes = draw(st.sampled_from(TILED_AXES))
        return Layout(axes, draw(st.sampled_from([4, 16])), dtype, v_axes=v_axes)
    bs = draw(st.sampled_from([1, 3, 4, 16]))
    if kind == "separate":
        return Layout(draw(st.sampled_from(["BNHC", "BHNC"])), bs, dtype, planes="separate")
    axes = draw(st.sampled_from(CROSS_AXES if kind == "cross" else PAGED_AXES))
    return Layout(axes, bs, dtype)


@st.composite
def descriptors(draw) -> Descriptor:
    if draw(st.integers(0, 4)) == 0:
        model = ModelSpec(
            (
                LayerSpec(
                    MLA,
                    latent_dim=draw(st.sampled_from([16, 512])),
                    rope_dim=draw(st.sampled_from([0, 8, 64])),
                    indexer_dim=draw(st.sampled_from([0, 0, 8, 128])),  # V3.2 (ABI 1.3)
                ),
            )
            * 2,
            "mla",
        )
        return Descriptor(model, Layout("BNHC", draw(st.integers(1, 64)), "bf16", planes="concat"))
    model = draw(attn_models())
    return Descriptor(model, draw(attn_layouts(model)))
