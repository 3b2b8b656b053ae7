"""Whole caches to a TP plan's shards and back, by KV head (kvabi/parallel/tp_plan.py).

Inside a tensor-parallel group each rank caches its plan's KV heads of every layer; outside it
(containers, tier entries, prefill/decode transfers) a cache is whole: every head, described
as the model is (tp 1/1), so a cache written at one TP size is read at any other. These two
functions are the boundary. `split_heads` gives rank r the heads [kv_start, kv_stop) of each
attention layer (a replicated head to every rank holding it); `merge_heads` takes each head
from the first rank holding it. An MLA latent is replicated: it is rank 0's, whole.

The ABI's `reshard` does the same for even plans (heads divisible by the rank count, each
rank described as shard r/n); the engine's plans may be uneven (SmolLM2's 3 KV heads over 2
ranks: 2 + 1), which the descriptor's TP axis cannot express, so the shards here are described
as caches of their own head counts and never leave the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvabi.abi.buffers import CacheBuffers, group_views
from kvabi.abi.descriptor import ATTN, MLA, Descriptor
from kvabi.parallel.tp_plan import TPPlan, rank_spec


def shard_descs(whole: Descriptor, plan: TPPlan) -> list[Descriptor]:
    """Each rank's descriptor: the whole cache's layout over the rank's KV heads."""
    descs = []
    for rank in range(plan.size):
        model = replace(whole.model, layers=rank_spec(plan, whole.model.layers, rank))
        descs.append(Descriptor(model, whole.layout))
    return descs


def split_heads(
    whole: CacheBuffers, plan: TPPlan, descs: Sequence[Descriptor]
) -> list[CacheBuffers]:
    """The shards of `whole` (a cache of `descs`' layout), one per rank, as many blocks."""
    _check(whole.desc, plan)
    shards = [CacheBuffers.empty(d, whole.extent) for d in descs]
    for layer_id, rank, heads in _parts(whole.desc, plan):
        for (_, src), (_, dst) in _pairs(whole, shards[rank], layer_id):
            dst.copy_(src[:, :, heads])
    return shards


def merge_heads(
    shards: Sequence[CacheBuffers], plan: TPPlan, whole_desc: Descriptor
) -> CacheBuffers:
    """The whole cache (of `whole_desc`) the ranks' `shards` hold, as many blocks."""
    _check(whole_desc, plan)
    whole = CacheBuffers.empty(whole_desc, shards[0].extent)
    for layer_id, rank, heads in _parts(whole_desc, plan):
        if _is_first_holder(plan, layer_id, rank):
            for (_, dst), (_, src) in _pairs(whole, shards[rank], layer_id):
                dst[:, :, heads].copy_(src)
    return whole


def _parts(desc: Descriptor, plan: TPPlan):
    """(layer, rank, its heads) of every layer that stores KV (a shared layer reads its
    target's; an MLA latent is one head, every rank's)."""
    for layer_id, spec in enumerate(desc.model.layers):
        if spec.kind == MLA:
            for rank in range(plan.size):
                yield layer_id, rank, slice(0, 1)
        elif spec.kind == ATTN:
            for rank, s in enumerate(plan.layers[layer_id]):
                yield layer_id, rank, slice(s.kv_start, s.kv_stop)


def _is_first_holder(plan: TPPlan, layer_id: int, rank: int) -> bool:
    shards = plan.layers[layer_id]
    return all(s.kv_start != shards[rank].kv_start for s in shards[:rank])


def _pairs(a: CacheBuffers, b: CacheBuffers, layer_id: int) -> list[tuple]:
    """One layer's plane groups of two caches of one layout, side by side
    (`[block, slot, head, content]` views)."""
    views_a = group_views(a.desc, a.tensors, layer_id)
    views_b = group_views(b.desc, b.tensors, layer_id)
    return list(zip(views_a, views_b, strict=True))


def _check(desc: Descriptor, plan: TPPlan) -> None:
    lay = desc.layout
    if (lay.tp_size, lay.tp_rank) != (1, 0) or lay.is_tiled:
        raise ValueError(f"tp: a whole cache splits by head in a strided tp 1/1 layout, not {lay}")
    if any(x.sidecar_planes for x in desc.model.layers):
        raise ValueError("tp: a cache with sidecar planes does not split by head")
    if len(plan.layers) != desc.model.num_layers:
        raise ValueError(f"tp: a plan of {len(plan.layers)} layers for {desc.model.num_layers}")
