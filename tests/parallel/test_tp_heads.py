"""Whole caches to a TP plan's shards and back (kvabi/parallel/tp_heads.py), against two
independent constructions: raw tensors whose every value names its (layer, plane, block, slot,
head) sliced by the plan's head ranges by hand, and, where the plan is even, the ABI's own
`reshard` into tp_size shards."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import reshard
from kvabi.abi.descriptor import ATTN, MLA, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.parallel.tp_heads import merge_heads, shard_descs, split_heads
from kvabi.parallel.tp_plan import plan_tp

NUM_BLOCKS, BLOCK, DIM = 3, 4, 8


def whole_cache(layers: tuple[LayerSpec, ...], preset: str) -> CacheBuffers:
    desc = preset_descriptor(preset, ModelSpec(layers, "tp-heads"), block_size=BLOCK, dtype="f32")
    cache = CacheBuffers.empty(desc, NUM_BLOCKS)
    for key, t in cache.tensors.items():  # every element distinct: the tensor's key and index
        values = torch.arange(t.numel(), dtype=torch.float32) + 1e6 * int(key.split(".")[0])
        t.copy_(values.view_as(t).to(t.dtype))
    return cache


def head_dim_of(preset: str) -> int:
    """The H axis of a raw per-layer tensor: [2, B, N, H, C] (NHD) or [2, B, H, N, C] (HND)."""
    return 2 if preset.endswith("hnd") else 3


@pytest.mark.parametrize("preset", ["vllm-flash-attn", "vllm-flash-attn-hnd"])
@pytest.mark.parametrize(
    "heads,kv,size",
    [(9, 3, 2), (9, 3, 3), (4, 1, 2), (4, 1, 3), (12, 4, 3), (8, 4, 2)],
)
def test_each_rank_gets_its_plans_heads(preset, heads, kv, size) -> None:
    layers = (LayerSpec(ATTN, kv, DIM, DIM),) * 2
    plan = plan_tp(heads, layers, None, size)
    whole = whole_cache(layers, preset)
    descs = shard_descs(whole.desc, plan)
    shards = split_heads(whole, plan, descs)
    axis = head_dim_of(preset)
    for rank, shard in enumerate(shards):
        assert shard.desc == descs[rank]
        for layer_id, layer in enumerate(plan.layers):
            s = layer[rank]
            want = whole.tensors[str(layer_id)].narrow(axis, s.kv_start, s.num_kv_heads)
            assert torch.equal(shard.tensors[str(layer_id)], want)
    back = merge_heads(shards, plan, whole.desc)
    for key, t in whole.tensors.items():
        assert torch.equal(back.tensors[key], t)


def test_merge_takes_a_replicated_head_from_its_first_holder() -> None:
    layers = (LayerSpec(ATTN, 1, DIM, DIM),)
    plan = plan_tp(4, layers, None, 2)  # one KV head on both ranks
    assert all(s.replicated for s in plan.layers[0])
    whole = whole_cache(layers, "vllm-flash-attn")
    shards = split_heads(whole, plan, shard_descs(whole.desc, plan))
    shards[1].tensors["0"].fill_(-1.0)  # rank 1's copy is never read
    assert torch.equal(merge_heads(shards, plan, whole.desc).tensors["0"], whole.tensors["0"])


def test_an_mla_latent_is_replicated_whole() -> None:
    layers = (LayerSpec(MLA, latent_dim=16, rope_dim=8),) * 2
    plan = plan_tp(4, layers, None, 2)
    whole = whole_cache(layers, "vllm-mla")
    shards = split_heads(whole, plan, shard_descs(whole.desc, plan))
    for shard in shards:
        for key, t in whole.tensors.items():
            assert torch.equal(shard.tensors[key], t)
    assert torch.equal(merge_heads(shards, plan, whole.desc).tensors["1"], whole.tensors["1"])


@pytest.mark.parametrize("heads,kv,size", [(8, 4, 2), (12, 6, 3), (4, 4, 4)])
def test_an_even_plan_splits_as_the_abis_reshard(heads, kv, size) -> None:
    layers = (LayerSpec(ATTN, kv, DIM, DIM),) * 2
    plan = plan_tp(heads, layers, None, size)
    whole = whole_cache(layers, "vllm-flash-attn")
    ours = split_heads(whole, plan, shard_descs(whole.desc, plan))
    abi = reshard([whole], whole.desc.with_layout(tp_size=size, tp_rank=0))
    for mine, theirs in zip(ours, abi, strict=True):
        for key in whole.tensors:
            assert torch.equal(mine.tensors[key], theirs.tensors[key])


def test_refusals() -> None:
    layers = (LayerSpec(ATTN, 3, DIM, DIM),) * 2
    plan = plan_tp(9, layers, None, 2)
    whole = whole_cache(layers, "vllm-flash-attn")
    even = (LayerSpec(ATTN, 4, DIM, DIM),) * 2
    shard = whole_cache(even, "vllm-flash-attn").desc.with_layout(tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="tp 1/1"):
        merge_heads([whole, whole], plan_tp(8, even, None, 2), shard)
    with pytest.raises(ValueError, match="a plan of 2 layers for 3"):
        three = Descriptor(ModelSpec(layers + layers[:1], "x"), whole.desc.layout)
        merge_heads([whole, whole], plan, three)
    dsa = (LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=16),)
    sidecar = whole_cache(dsa, "vllm-mla")
    with pytest.raises(ValueError, match="sidecar"):
        split_heads(sidecar, plan_tp(2, dsa, None, 2), [sidecar.desc] * 2)
