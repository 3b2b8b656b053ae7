"""A tensor-parallel plan as data: which heads and MLP columns each rank holds, per layer.

Standard TP divides every layer's heads by the rank count. Models whose heads do not divide
(SmolLM2: 9 query, 3 KV heads), with fewer KV heads than ranks (Gemma 3: one), or with
heads that vary by layer need a plan per layer:

- KV heads at least as many as ranks: each rank takes a contiguous run of KV heads, as even
  as the count allows (the first ranks one more), and the query heads of those KV heads'
  groups (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).
- Fewer KV heads than ranks: rank r holds KV head r * num_kv_heads // size, replicated on
  every rank that holds it too (`replicated`), and those ranks split its group's query heads
  between them.
- An MLA layer keeps one latent for all heads: replicated on every rank, the query heads
  split evenly.
- The MLP's intermediate columns split evenly (the first ranks one more).

Every rank holds at least one query head; a plan with more ranks than query heads is refused.
After the attention output and the MLP down projections the ranks all-reduce (sum) their
partial outputs; a bias on either is added by rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvabi.abi.descriptor import MLA, LayerSpec


class TPPlanError(ValueError):
    """A model and rank count that no plan fits."""


@dataclass(frozen=True)
class HeadShard:
    """One rank's part of one layer: query heads [q_start, q_stop), KV heads [kv_start,
    kv_stop) (the KV heads' index in the layer; `replicated`: other ranks hold them too)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    replicated: bool

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


@dataclass(frozen=True)
class TPPlan:
    size: int
    layers: tuple[tuple[HeadShard, ...], ...]  # per layer, per rank
    mlp: tuple[tuple[int, int], ...]  # per rank: intermediate columns [start, stop); () unknown

    def rank_heads(self, rank: int) -> tuple[HeadShard, ...]:
        """Rank `rank`'s shard of every layer."""
        return tuple(layer[rank] for layer in self.layers)

    def describe(self) -> list[list[object]]:
        """Table rows (runs of alike layers together): layers, rank, query heads, KV heads,
        replicated."""
        rows: list[list[object]] = []
        start = 0
        for i in range(1, len(self.layers) + 1):
            if i < len(self.layers) and self.layers[i] == self.layers[start]:
                continue
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            for r, s in enumerate(self.layers[start]):
                q, kv = f"{s.q_start}..{s.q_stop - 1}", f"{s.kv_start}..{s.kv_stop - 1}"
                rows.append([span, r, q, kv, "yes" if s.replicated else "no"])
            start = i
        return rows


def even_split(total: int, size: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of `size` contiguous parts of `total`, the first ones one larger."""
    base, extra = divmod(total, size)
    out, start = [], 0
    for r in range(size):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def layer_shards(num_heads: int, spec: LayerSpec, size: int) -> tuple[HeadShard, ...]:
    """One layer's shards over `size` ranks (module docstring)."""
    if num_heads < size:
        raise TPPlanError(f"tp: {num_heads} query heads cannot be spread over {size} ranks")
    if spec.kind == MLA:
        return tuple(HeadShard(a, b, 0, 1, size > 1) for a, b in even_split(num_heads, size))
    kv = spec.num_kv_heads
    if num_heads % kv:
        raise TPPlanError(f"tp: {num_heads} query heads are not groups of {kv} KV heads")
    group = num_heads // kv
    if kv >= size:
        return tuple(HeadShard(a * group, b * group, a, b, False) for a, b in even_split(kv, size))
    shards = []
    owners = [r * kv // size for r in range(size)]  # the KV head each rank holds
    for r, head in enumerate(owners):
        sharing = [i for i, h in enumerate(owners) if h == head]  # ranks holding that head
        if group < len(sharing):
            raise TPPlanError(
                f"tp: KV head {head}'s {group} query heads cannot be spread over "
                f"{len(sharing)} ranks"
            )
        a, b = even_split(group, len(sharing))[sharing.index(r)]
        shared = len(sharing) > 1
        shards.append(HeadShard(head * group + a, head * group + b, head, head + 1, shared))
    return tuple(shards)


def plan_tp(
    num_heads: int | tuple[int, ...],
    kv_layers: tuple[LayerSpec, ...],
    intermediate_size: int | None,
    size: int,
) -> TPPlan:
    """The plan for a model with `num_heads` query heads (one count, or one per layer), the
    KV layers `kv_layers` and an MLP of `intermediate_size` (None: heads only), over `size`
    ranks."""
    if size < 1:
        raise TPPlanError(f"tp: the rank count must be >= 1, got {size}")
    heads = (num_heads,) * len(kv_layers) if isinstance(num_heads, int) else num_heads
    if intermediate_size is not None and intermediate_size < size:
        raise TPPlanError(f"tp: an MLP of {intermediate_size} cannot be split {size} ways")
    layers = tuple(layer_shards(h, spec, size) for h, spec in zip(heads, kv_layers, strict=True))
    mlp = () if intermediate_size is None else even_split(intermediate_size, size)
    return TPPlan(size, layers, mlp)


def rank_spec(plan: TPPlan, kv_layers: tuple[LayerSpec, ...], rank: int) -> tuple[LayerSpec, ...]:
    """The KV layers rank `rank` caches: its KV heads of each attention layer (an MLA latent
    whole)."""
    return tuple(
        spec if spec.kind == MLA else replace(spec, num_kv_heads=shard.num_kv_heads)
        for spec, shard in zip(kv_layers, plan.rank_heads(rank), strict=True)
    )
