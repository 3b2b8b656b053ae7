"""How an engine lays a hybrid model's KV groups out in memory: block groups over shared pools.

Every block group has its own block table per sequence; its blocks come from one block pool.
Groups whose layers have the same geometry (heads and dims, hence bytes per block) share a pool,
so memory moves freely between sliding and full-attention layers (vLLM's hybrid KV cache
manager). To share a pool, groups hold the same number of layers, `num_slots`: each of the
ABI's KV cache groups (kvabi/abi/kv_groups.py) is cut into runs of at most that many layers, and
the pool's storage has `num_slots` per-layer tensors, slot j holding layer j of whichever group
owns a block (Gemma 3 270M: 15 sliding + 3 full layers -> 6 groups of 3 over one pool).

A model with one kind of layer has one group over one pool whose storage is the descriptor
itself: the uniform engine, unchanged. Shared layers read their target's slot; `none` layers
have no KV.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvabi.abi.descriptor import SHARED, LayerSpec, ModelSpec
from kvabi.abi.kv_groups import kv_groups


@dataclass(frozen=True)
class BlockGroup:
    """One block table's layers: slot j of pool `pool_id` holds `layer_ids[j]`."""

    group_id: int
    layer_ids: tuple[int, ...]
    window: int  # tokens; 0 = full attention (the group needs every block of a sequence)
    pool_id: int


@dataclass(frozen=True)
class GroupPlan:
    groups: tuple[BlockGroup, ...]
    pool_specs: tuple[ModelSpec, ...]  # per pool: its storage's layers, one per slot
    layer_slots: tuple[tuple[int, int], ...]  # per model layer: (group_id, slot); (-1, -1): none

    @property
    def is_uniform(self) -> bool:
        """One group of full-attention layers: the plain engine."""
        return len(self.groups) == 1 and self.groups[0].window == 0

    def group_of(self, layer_id: int) -> int:
        return self.layer_slots[layer_id][0]


def _geometry(spec: LayerSpec) -> LayerSpec:
    return replace(spec, window=0)


def plan_groups(model: ModelSpec) -> GroupPlan:
    """The block groups and pools of a model's cache (see the module docstring)."""
    abi_groups = kv_groups(model)
    if not abi_groups:
        raise ValueError("kv cache: the model has no layer with KV of its own")
    by_geometry: dict[LayerSpec, list] = {}
    for g in abi_groups:
        by_geometry.setdefault(_geometry(g.spec), []).append(g)
    groups: list[BlockGroup] = []
    pool_specs: list[ModelSpec] = []
    for pool_id, (geometry, members) in enumerate(by_geometry.items()):
        num_slots = min(len(g.layer_ids) for g in members)
        for g in members:
            for start in range(0, len(g.layer_ids), num_slots):
                layer_ids = g.layer_ids[start : start + num_slots]
                groups.append(BlockGroup(len(groups), layer_ids, g.window, pool_id))
        # Every layer in one group: the storage is the model's own descriptor (its slots are
        # its layers). With a shared or KV-less layer among them, the slots are the owners.
        is_whole = len(abi_groups) == 1 and all(x.has_kv for x in model.layers)
        slots = model if is_whole else ModelSpec((geometry,) * num_slots, model.fingerprint)
        pool_specs.append(slots)
    slot_of = {i: (g.group_id, j) for g in groups for j, i in enumerate(g.layer_ids)}
    layer_slots = tuple(
        slot_of.get(x.shares if x.kind == SHARED else i, (-1, -1))
        for i, x in enumerate(model.layers)
    )
    return GroupPlan(tuple(groups), tuple(pool_specs), layer_slots)
