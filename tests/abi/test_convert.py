import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi.abi.buffers import CacheBuffers, allocate, owner_layers
from kvabi.abi.convert import convert, read_planes, reshard
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import IncompatibleError, ShapeError
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.abi.rope import permute_pairing
from tests.abi.strategies import attn_layouts, attn_models

LOSSLESS = [n for n, p in PRESETS.items() if p.kind == ATTN and p.layout.quant == "none"]


def _filled(desc: Descriptor, extent: int, seed: int = 0) -> CacheBuffers:
    """Values exact in f32, bf16 and f16 (multiples of 1/8 below 16), so every cast is lossless."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: (torch.randint(-127, 128, v.shape, generator=g) / 8).to(v.dtype)
        for k, v in allocate(desc, extent).items()
    }
    return CacheBuffers(desc, tensors)


def _same_tokens(a: CacheBuffers, b: CacheBuffers, n: int, a_ids=None, b_ids=None) -> bool:
    for layer in owner_layers(a.desc):
        pa, pb = read_planes(a, layer, n, a_ids), read_planes(b, layer, n, b_ids)
        if a.desc.model.rope_pairing != b.desc.model.rope_pairing:
            pb["k"] = permute_pairing(
                pb["k"], b.desc.model.rope_pairing, a.desc.model.rope_pairing, a.desc.model.rope_dim
            )
        if pa.keys() != pb.keys() or not all(torch.equal(pa[k], pb[k]) for k in pa):
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_geometries_round_trip_bit_exactly(data):
    model = data.draw(attn_models())
    a = Descriptor(model, data.draw(attn_layouts(model)))
    b_model = ModelSpec(
        model.layers, model.fingerprint, rope_pairing=data.draw(st.sampled_from(["half", "pairs"]))
    )
    b = Descriptor(b_model, data.draw(attn_layouts(model)))
    n = data.draw(st.integers(1, 40))
    src = _filled(a, -(-n // a.layout.block_size) if a.layout.is_paged else n)
    there = convert(src, b, num_tokens=n)
    back = convert(there, a, num_tokens=n)
    assert _same_tokens(src, there, n)
    assert _same_tokens(src, back, n)


@pytest.mark.parametrize("src_name", LOSSLESS)
def test_every_lossless_preset_pair_round_trips(src_name):
    model = ModelSpec((LayerSpec(ATTN, 2, 16, 16),) * 2, "m")
    src = _filled(
        preset_descriptor(src_name, model), 7 if PRESETS[src_name].layout.is_paged else 100
    )
    n = 100 if not src.desc.layout.is_paged else 7 * src.desc.layout.block_size
    for dst_name in LOSSLESS:
        there = convert(src, preset_descriptor(dst_name, model), num_tokens=n)
        back = convert(there, src.desc, num_tokens=n)
        assert _same_tokens(src, back, n), dst_name
        if back.desc.layout.is_paged and n % back.desc.layout.block_size == 0:
            for key, t in src.tensors.items():
                assert torch.equal(back.tensors[key], t), (dst_name, key)


def test_whole_pool_permutation_is_bit_exact_and_keeps_every_block():
    model = ModelSpec((LayerSpec(ATTN, 4, 32, 32),) * 3, "m")
    src = _filled(preset_descriptor("vllm-flash-attn", model), 9)
    for name in ("vllm-flashinfer-hnd", "vllm-lbnhc", "trtllm"):
        dst = convert(src, preset_descriptor(name, model, block_size=16))
        assert dst.extent == 9
        assert torch.equal(convert(dst, src.desc).tensors["2"], src.tensors["2"])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gather_scatter_through_block_tables(data):
    model = data.draw(attn_models(max_layers=2))
    a = Descriptor(model, Layout("BKHNC", data.draw(st.sampled_from([2, 4])), "f32"))
    b = Descriptor(model, Layout("KBNHC", data.draw(st.sampled_from([2, 3, 4])), "bf16"))
    n = data.draw(st.integers(1, 20))
    a_ids = data.draw(st.permutations(range(12)))[: -(-n // a.layout.block_size)]
    b_ids = data.draw(st.permutations(range(12)))[: -(-n // b.layout.block_size)]
    src = _filled(a, 12)
    pool = CacheBuffers.empty(b, 12, "zeros")
    convert(src, b, num_tokens=n, src_block_ids=a_ids, dst_block_ids=b_ids, out=pool)
    assert _same_tokens(src, pool, n, a_ids, b_ids)
    untouched = set(range(12)) - set(b_ids)
    for t in pool.tensors.values():
        assert all(not t[:, i].any() for i in untouched)


@pytest.mark.parametrize("max_runs", [0, 1000])  # an index op per plane; a slice per run
@pytest.mark.parametrize("dst_name", ["vllm-flash-attn", "vllm-cpu-amx", "vllm-cpu-vec"])
def test_whole_blocks_through_scattered_tables_both_ways(dst_name, max_runs, monkeypatch):
    from kvabi.abi import tiled_view

    monkeypatch.setattr(tiled_view, "MAX_RUNS", max_runs)
    model = ModelSpec((LayerSpec(ATTN, 2, 32, 32),) * 2, "m")
    a = preset_descriptor("vllm-flash-attn-hnd", model, block_size=16, dtype="bf16")
    b = preset_descriptor(dst_name, model, block_size=32, dtype="bf16")
    a_ids, b_ids = [9, 2, 7, 0, 5, 3, 11, 1], [6, 0, 4, 2]  # 128 tokens, no two consecutive
    src = _filled(a, 12)
    pool = CacheBuffers.empty(b, 8, "zeros")
    convert(src, b, num_tokens=128, src_block_ids=a_ids, dst_block_ids=b_ids, out=pool)
    assert _same_tokens(src, pool, 128, a_ids, b_ids)
    back = CacheBuffers.empty(a, 12, "zeros")
    convert(pool, a, num_tokens=128, src_block_ids=b_ids, dst_block_ids=a_ids, out=back)
    assert _same_tokens(src, back, 128, a_ids, a_ids)


@pytest.mark.parametrize("m, n", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4)])
def test_tp_reshard_m_to_n_with_per_layer_heads(m, n):
    model = ModelSpec((LayerSpec(ATTN, 4, 16, 16), LayerSpec(ATTN, 8, 8, 8)), "m")
    full = _filled(preset_descriptor("vllm-flashinfer-hnd", model, block_size=4), 3)
    shards = reshard([full], full.desc.with_layout(tp_size=m)) if m > 1 else [full]
    assert [s.desc.layout.tp_rank for s in shards] == list(range(m))
    out = reshard(shards, preset_descriptor("vllm-flash-attn", model, block_size=4, tp_size=n))
    assert len(out) == n
    assert out[0].tensors["1"].shape[-2] == 8 // n
    again = reshard(out, full.desc)
    assert all(torch.equal(again[0].tensors[k], full.tensors[k]) for k in full.tensors)


def test_reshard_needs_every_shard_in_rank_order():
    model = ModelSpec((LayerSpec(ATTN, 4, 16, 16),), "m")
    full = _filled(preset_descriptor("vllm-flash-attn", model), 2)
    shards = reshard([full], full.desc.with_layout(tp_size=2))
    with pytest.raises(IncompatibleError, match="rank order"):
        reshard(shards[::-1], full.desc)
    with pytest.raises(IncompatibleError, match="every source shard"):
        reshard(shards[:1], full.desc)


def test_rope_pairing_permutation_is_explicit():
    half = torch.arange(8.0).reshape(1, 1, 8)  # dims 0..7: rotated pairs (i, i+4)
    pairs = permute_pairing(half, "half", "pairs")
    assert pairs.flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(permute_pairing(pairs, "pairs", "half"), half)
    partial = permute_pairing(half, "half", "pairs", rope_dim=4)  # dims past 4 stay
    assert partial.flatten().tolist() == [0, 2, 1, 3, 4, 5, 6, 7]


def test_incompatible_and_misshapen_input_is_refused():
    model = ModelSpec((LayerSpec(ATTN, 2, 16, 16),), "m")
    src = _filled(preset_descriptor("vllm-flash-attn", model), 2)
    other = ModelSpec(model.layers, "other-weights")
    with pytest.raises(IncompatibleError, match="fingerprint"):
        convert(src, preset_descriptor("vllm-flash-attn", other))
    with pytest.raises(IncompatibleError, match="block sizes"):
        convert(src, preset_descriptor("vllm-flash-attn", model, block_size=8))
    with pytest.raises(IncompatibleError, match="block table"):
        convert(src, src.desc, num_tokens=40, src_block_ids=[0])
    small = CacheBuffers.empty(preset_descriptor("vllm-flashinfer", model), 1)
    with pytest.raises(IncompatibleError, match="of 2 blocks into a cache of 1"):
        convert(src, small.desc, out=small)
    unpaged = convert(src, preset_descriptor("hf-dynamic", model), num_tokens=10)
    with pytest.raises(IncompatibleError, match="20 tokens asked of an unpaged source cache of 10"):
        convert(unpaged, preset_descriptor("hf-dynamic", model), num_tokens=20)
    bad = dict(src.tensors, **{"0": src.tensors["0"][:, :, :, :1]})
    with pytest.raises(ShapeError, match="buffer '0'"):
        CacheBuffers(src.desc, bad)
    with pytest.raises(ShapeError, match="dtype|bfloat16"):
        CacheBuffers(src.desc, {"0": src.tensors["0"].float()})


def test_convert_keeps_the_tp_shard_and_reshard_changes_it():
    """docs/ABI.md 3.4: `convert` refuses any other shard (rank or size); `reshard` does that."""
    model = ModelSpec((LayerSpec(ATTN, 4, 16, 16),), "m")
    full = _filled(preset_descriptor("vllm-flash-attn", model), 2)
    shards = reshard([full], full.desc.with_layout(tp_size=2))
    for src, dst in (
        (full, full.desc.with_layout(tp_size=2)),  # 1 -> 2
        (shards[0], full.desc),  # 2 -> 1
        (shards[0], shards[1].desc),  # rank 0 -> rank 1
    ):
        with pytest.raises(IncompatibleError, match="use reshard"):
            convert(src, dst)
    # the same shard converts (here to another layout), heads untouched
    hnd = preset_descriptor("vllm-flashinfer-hnd", model, block_size=16, tp_rank=1, tp_size=2)
    moved = convert(shards[1], hnd)
    assert torch.equal(read_planes(moved, 0, 32)["k"], read_planes(full, 0, 32)["k"][:, 2:])


@pytest.mark.parametrize(
    ("src_name", "dst_name"), [("vllm-flash-attn-hnd", "vllm-flash-attn"), ("sglang-mha", "trtllm")]
)
def test_layer_by_layer_conversion_equals_the_whole_and_leaves_other_layers(src_name, dst_name):
    model = ModelSpec(tuple(LayerSpec(ATTN, 2, 8, 8) for _ in range(4)), "t")
    src = _filled(preset_descriptor(src_name, model, block_size=4), 6, seed=1)
    dst_desc = preset_descriptor(dst_name, model, block_size=8)
    ids = dict(num_tokens=16, src_block_ids=[5, 1, 2, 0], dst_block_ids=[3, 0])
    whole = convert(src, dst_desc, **ids, out=_filled(dst_desc, 4, seed=2))
    parts = _filled(dst_desc, 4, seed=2)
    untouched = _filled(dst_desc, 4, seed=2)
    convert(src, dst_desc, **ids, out=parts, layer_ids=[0, 3])
    for layer in (1, 2):  # not converted yet: as they were
        assert torch.equal(
            read_planes(parts, layer, 32)["k"], read_planes(untouched, layer, 32)["k"]
        )
    convert(src, dst_desc, **ids, out=parts, layer_ids=[1, 2])
    assert all(torch.equal(parts.tensors[k], whole.tensors[k]) for k in whole.tensors)
