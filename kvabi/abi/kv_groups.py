"""KV cache groups (ABI 1.2): the layers that hold the same kind of KV, derived from the specs.

Layers with equal specs (kind, window, heads and dims, hence equal bytes per block) form one
group (compressed entries of one geometry too, whichever layer each compresses); groups are
numbered by their first layer. A hybrid model's engine keeps one block table per group per
sequence: a full-attention group holds every block of a sequence, a sliding group only those
its window still needs. Shared layers hold nothing and read their target's group; `none`
layers belong to no group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvabi.abi.descriptor import CENTRIES, SHARED, LayerSpec, ModelSpec


@dataclass(frozen=True)
class KVGroup:
    """One group: its owner layers (model order), their common spec, the layers that read it."""

    group_id: int
    layer_ids: tuple[int, ...]
    spec: LayerSpec
    reader_ids: tuple[int, ...] = ()

    @property
    def window(self) -> int:
        """The group's sliding window in tokens; 0 for full attention."""
        return self.spec.window


def group_spec(layer: LayerSpec) -> LayerSpec:
    """What a layer's group is keyed by: its spec (a centries layer's unbound from the layer it
    compresses, so that the compressed layers of one geometry form one group)."""
    return replace(layer, compresses=-1) if layer.kind == CENTRIES else layer


def kv_groups(model: ModelSpec) -> tuple[KVGroup, ...]:
    """The model's KV cache groups, in order of their first layer (docs/ABI.md 2.5)."""
    owners: dict[LayerSpec, list[int]] = {}
    for i, layer in enumerate(model.layers):
        if layer.has_kv:
            owners.setdefault(group_spec(layer), []).append(i)
    groups = []
    for group_id, (spec, layer_ids) in enumerate(owners.items()):
        readers = tuple(
            i
            for i, x in enumerate(model.layers)
            if x.kind == SHARED and model.layers[x.shares] == spec
        )
        groups.append(KVGroup(group_id, tuple(layer_ids), spec, readers))
    return tuple(groups)


def layer_groups(model: ModelSpec) -> tuple[int, ...]:
    """Per layer, the group whose KV it reads (a shared layer: its target's); -1 for none."""
    of = {i: g.group_id for g in kv_groups(model) for i in g.layer_ids}
    return tuple(
        of.get(x.shares if x.kind == SHARED else i, -1) for i, x in enumerate(model.layers)
    )


def window_start(window: int, num_tokens: int) -> int:
    """The first token a layer of `window` (0: full attention) still needs once a sequence
    holds `num_tokens` tokens: the next query, at position num_tokens, attends to keys
    num_tokens - window + 1 .. num_tokens (docs/ABI.md 2.5)."""
    return max(num_tokens - window + 1, 0) if window else 0
