"""Conversion between any two descriptors of one model: one generic path, no code per pair.

Each side yields canonical `[block, slot, head, content]` views (buffers.py). When the two sides
store the same values the same way, a view-to-view `copy_` per plane moves the bytes (axis
permutation, K/V placement, float casts). Otherwise tokens are gathered through the block
tables, decoded to float32, permuted (RoPE pairing), re-sharded (TP) and encoded on the way in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvabi.abi.block_copy import can_copy, copy_blocks
from kvabi.abi.buffers import CacheBuffers, group_views, owner_layers
from kvabi.abi.codec import _scale, decode, encode
from kvabi.abi.compat import check_compatible
from kvabi.abi.descriptor import ATTN, Descriptor, Layout, Plane
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.reblock import Run, plan_runs, reblocked_pairs
from kvabi.abi.reblock_plan import reblock_plan
from kvabi.abi.rope import permute_pairing
from kvabi.abi.sidecar import copy_sidecars
from kvabi.abi.tiled_view import (
    CanonicalView,
    block_runs,
    gather,
    gather_blocks,
    scatter,
    scatter_blocks,
)
from kvabi.abi.view_copy import (
    COPY,
    FROM_E4M3,
    FROM_INT8_ROWS,
    TO_E4M3,
    TO_F32,
    TO_INT8_ROWS,
    CopyPlan,
    RowOp,
    geometry,
)
from kvabi.native.cpu_kernels import cpu_kernels

GroupViews = list[tuple[tuple[Plane, ...], CanonicalView]]


@dataclass(frozen=True)
class SlotMap:
    """Token t of a sequence lives at (block_ids[t], slots[t]) of its cache. When the tokens
    fill whole blocks of a paged cache, `table` names those blocks in order (then whole blocks
    move at once)."""

    block_ids: torch.Tensor | None  # [num_tokens] int64 (None: whole blocks, `table`)
    slots: torch.Tensor | None  # [num_tokens] int64
    table: torch.Tensor | None = None  # [num_tokens // block_size] int64
    runs: list[range] | None = None  # `table`'s runs of consecutive blocks

    @classmethod
    def build(
        cls,
        layout: Layout,
        num_tokens: int,
        block_table: Sequence[int] | None,
        num_blocks: int | None = None,
        per: tuple[int, int] = (1, 1),
    ) -> SlotMap:
        """`per` (rows, tokens): a layer keeping fewer rows than tokens (a centries layer: one
        per `ratio`, `LayerSpec.rows_per_token`) maps the rows of the tokens' whole windows."""
        rows, tokens = per
        num_rows = num_tokens * rows // tokens
        t = torch.arange(num_rows)
        if not layout.is_paged:
            if num_blocks is not None and num_rows > num_blocks:
                raise IncompatibleError(
                    f"{num_tokens} tokens asked of an unpaged cache of {num_blocks}"
                )
            return cls(torch.zeros_like(t), t)
        bs = layout.block_size * rows // tokens
        table = block_table_for(layout, num_tokens, block_table, num_blocks)
        if num_tokens % layout.block_size == 0 and len(table) * bs == num_rows:
            return cls(None, None, table, block_runs(table))  # whole blocks move at once
        return cls(table[t // bs], t % bs)

    def gather(self, view: CanonicalView) -> torch.Tensor:
        """The stored content of the mapped tokens: `[T, H, C]` (a copy)."""
        if self.table is not None:
            return gather_blocks(view, self.table, self.runs)
        return gather(view, self.block_ids, self.slots)

    def scatter(self, view: CanonicalView, values: torch.Tensor) -> None:
        """Store `values` `[T, H, C]` at the mapped tokens, in place."""
        if self.table is not None:
            scatter_blocks(view, self.table, values, self.runs)
        else:
            scatter(view, self.block_ids, self.slots, values)


def block_table_for(
    layout: Layout,
    num_tokens: int,
    block_table: Sequence[int] | None,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """The blocks (int64) holding a sequence's `num_tokens` tokens; checked to be enough and,
    given `num_blocks`, to exist."""
    needed = -(-num_tokens // layout.block_size)
    table = torch.arange(needed) if block_table is None else torch.as_tensor(block_table).long()
    if len(table) < needed:
        raise IncompatibleError(
            f"block table has {len(table)} blocks; {num_tokens} tokens "
            f"need {needed} of {layout.block_size} slots"
        )
    table = table[:needed]
    if num_blocks is not None and needed and (table.min() < 0 or table.max() >= num_blocks):
        raise IncompatibleError(f"block table names blocks outside [0, {num_blocks})")
    return table


def convert(
    src: CacheBuffers,
    dst_desc: Descriptor,
    *,
    num_tokens: int | None = None,
    src_block_ids: Sequence[int] | None = None,
    dst_block_ids: Sequence[int] | None = None,
    out: CacheBuffers | None = None,
    layer_ids: Sequence[int] | None = None,
) -> CacheBuffers:
    """Convert one cache to `dst_desc`'s layout (same TP shard).

    With `num_tokens=None` the whole cache converts block for block (block sizes must agree).
    Otherwise the sequence's first `num_tokens` tokens move through the two block tables
    (default: blocks 0, 1, ...), into `out` if given (e.g. an engine's block pool). With
    `layer_ids`, only those layers move (the rest of `out` is left as it was).
    """
    if (src.desc.layout.tp_size, src.desc.layout.tp_rank) != (
        dst_desc.layout.tp_size,
        dst_desc.layout.tp_rank,
    ):
        raise IncompatibleError("convert keeps the TP shard; use reshard to change it")
    return reshard(
        [src],
        dst_desc,
        num_tokens=num_tokens,
        src_block_ids=src_block_ids,
        dst_block_ids=dst_block_ids,
        out=None if out is None else [out],
        layer_ids=layer_ids,
    )[0]


def reshard(
    srcs: Sequence[CacheBuffers],
    dst_desc: Descriptor,
    *,
    num_tokens: int | None = None,
    src_block_ids: Sequence[int] | None = None,
    dst_block_ids: Sequence[int] | None = None,
    out: Sequence[CacheBuffers] | None = None,
    layer_ids: Sequence[int] | None = None,
) -> list[CacheBuffers]:
    """Convert the m TP shards of a cache (rank order) into the n shards of `dst_desc`'s tp_size.

    Returns n caches (or, when `dst_desc.layout.tp_size` equals 1 or matches m and one source
    is given, the single shard of `dst_desc.layout.tp_rank`). With `layer_ids`, only those
    (owner) layers move, layer by layer.
    """
    src_desc = _check_sources(srcs, dst_desc)
    dst_descs = _dst_shards(srcs, dst_desc)
    whole = num_tokens is None
    if whole and src_desc.layout.block_size != dst_desc.layout.block_size:
        raise IncompatibleError(
            "whole-cache conversion needs equal block sizes; give num_tokens "
            "and block tables to re-block a sequence"
        )
    if src_desc.layout.block_size != dst_desc.layout.block_size and any(
        x.state_bytes for x in src_desc.model.layers
    ):
        raise IncompatibleError(
            "compressed entries keep their compressor's state at each block's end: a cache "
            f"of blocks of {src_desc.layout.block_size} converts to blocks of that size only, "
            f"not {dst_desc.layout.block_size}"
        )
    extent = srcs[0].extent if whole else _dst_extent(dst_desc.layout, num_tokens, dst_block_ids)
    outs = list(out) if out is not None else [CacheBuffers.empty(d, extent) for d in dst_descs]
    if whole and outs[0].extent != srcs[0].extent:
        raise IncompatibleError(
            f"whole-cache conversion of {srcs[0].extent} blocks into a cache of {outs[0].extent}"
        )
    for side, cache in (("source", srcs[0]), ("destination", outs[0])):
        if not whole and not cache.desc.layout.is_paged and num_tokens > cache.extent:
            raise IncompatibleError(
                f"{num_tokens} tokens asked of an unpaged {side} cache of {cache.extent}"
            )
    layers = owner_layers(src_desc)
    if layer_ids is not None:
        wanted = set(layer_ids)
        layers = [i for i in layers if i in wanted]
    elif _is_same_blocks(srcs, outs, dst_desc, num_tokens):
        n = srcs[0].extent * src_desc.layout.block_size if whole else num_tokens
        s_ids = block_table_for(src_desc.layout, n, src_block_ids, srcs[0].extent)
        d_ids = block_table_for(dst_desc.layout, n, dst_block_ids, outs[0].extent)
        copy_blocks(srcs[0], outs[0], s_ids.tolist(), d_ids.tolist())
        return outs
    planned = _is_direct(src_desc, dst_desc, len(srcs)) or _is_row_codec(srcs, dst_desc)
    if whole and planned and layer_ids is None and _run_plan(srcs[0], outs[0]):
        for layer_id in layers:
            copy_sidecars(layer_id, srcs[0], outs, num_tokens, src_block_ids, dst_block_ids)
        return outs
    maps: dict[tuple[int, int], tuple[SlotMap, SlotMap]] = {}
    runs = _reblock_runs(srcs, outs[0], num_tokens, src_block_ids, dst_block_ids)
    if runs is not None and (plan := reblock_plan(srcs[0], outs[0])):
        plan.run(srcs[0], outs[0], runs, layer_ids)  # the copies' offsets worked out once
        return outs
    for layer_id in layers:
        src_views = [group_views(s.desc, s.tensors, layer_id) for s in srcs]
        dst_views = [group_views(o.desc, o.tensors, layer_id) for o in outs]
        if runs is not None:  # whole blocks of one size into another's: one pass
            planes = zip(_plane_views(src_views[0]), _plane_views(dst_views[0]), strict=True)
            for (_, sv), (_, dv) in planes:
                for dst, src in reblocked_pairs(sv, dv, runs):
                    dst.copy_(src)
        elif _is_direct(src_desc, dst_desc, len(srcs)):
            _copy_direct(
                src_views[0],
                dst_views[0],
                whole,
                num_tokens,
                src_desc,
                dst_desc,
                src_block_ids,
                dst_block_ids,
            )
        else:
            n = srcs[0].extent * max(src_desc.layout.block_size, 1) if whole else num_tokens
            per = src_desc.model.layers[layer_id].rows_per_token
            if per not in maps:  # every layer of one kind maps its tokens alike
                maps[per] = (
                    SlotMap.build(src_desc.layout, n, src_block_ids, srcs[0].extent, per),
                    SlotMap.build(dst_desc.layout, n, dst_block_ids, outs[0].extent, per),
                )
            src_map, dst_map = maps[per]
            _copy_tokens(layer_id, srcs, src_views, src_map, outs, dst_views, dst_map)
        copy_sidecars(layer_id, srcs[0], outs, num_tokens, src_block_ids, dst_block_ids)
    return outs


_PLANS: dict[tuple, CopyPlan | None] = {}  # by (descriptors, buffer geometries); None: refused
_MAX_PLANS = 256


def _run_plan(src: CacheBuffers, out: CacheBuffers) -> bool:
    """Convert a whole cache into another layout's buffers by a `CopyPlan`: its views' copies
    (or, into an fp8 per-tensor or int8 per-token-head layout, their rows' quantisation) in one
    C++ call, offsets worked out once per geometry. False where there is none (no kernels, or a
    view the kernel does not take): the caller converts view by view."""
    kernels = cpu_kernels()
    if kernels is None:
        return False
    key = (src.desc, out.desc, geometry(src.tensors), geometry(out.tensors))
    if key not in _PLANS:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = _plan(src, out)
    plan = _PLANS[key]
    if plan is None:
        return False
    plan.run(out.tensors, src.tensors, kernels)
    return True


def _plan(src: CacheBuffers, out: CacheBuffers) -> CopyPlan | None:
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    ops: list[RowOp] = []
    for layer_id in owner_layers(src.desc):
        src_views = group_views(src.desc, src.tensors, layer_id)
        dst_views = group_views(out.desc, out.tensors, layer_id)
        if _is_direct(src.desc, out.desc, 1):
            start = len(pairs)
            _copy_direct(src_views, dst_views, True, None, src.desc, out.desc, None, None, pairs)
            widen = (src.desc.layout.dtype, out.desc.layout.dtype) == ("bf16", "f32")
            ops += [RowOp(TO_F32 if widen else COPY)] * (len(pairs) - start)
            continue
        quantise = src.desc.layout.quant == "none"  # else the rows go back to bf16
        rows, values = (dst_views, src_views) if quantise else (src_views, dst_views)
        planes = {p.name: view for (p,), view in _plane_views(values)}
        lay = (out if quantise else src).desc.layout  # the quantised side's
        for group, view in rows:
            if len(group) != 1:  # a row's scale would cover several planes
                return None
            plane = planes[group[0].name]
            pairs.append((view, plane) if quantise else (plane, view))
            if lay.quant == "per_token_head":
                ops.append(RowOp(TO_INT8_ROWS if quantise else FROM_INT8_ROWS))
            else:
                ops.append(
                    RowOp(TO_E4M3 if quantise else FROM_E4M3, _scale(lay, layer_id, group[0]))
                )
    return CopyPlan.build(pairs, out.tensors, src.tensors, ops or None)


def _is_row_codec(srcs: Sequence[CacheBuffers], dst_desc: Descriptor) -> bool:
    """Whether a whole cache of bf16 values goes into `dst_desc`'s fp8 e4m3 per-tensor or int8
    per-token-head rows, or such rows back into bf16, with nothing else changing (a `CopyPlan`
    with row ops takes it; a bf16 -> float32 conversion is a direct one, widened row by row)."""
    s, d, src = srcs[0].desc.layout, dst_desc.layout, srcs[0].desc
    rows = (("per_tensor", "fp8_e4m3"), ("per_token_head", "int8"))
    return (
        len(srcs) == 1
        and (
            ((s.quant, s.dtype) == ("none", "bf16") and (d.quant, d.dtype) in rows)
            or ((s.quant, s.dtype) in rows and (d.quant, d.dtype) == ("none", "bf16"))
        )
        and (s.tp_size, s.tp_rank) == (d.tp_size, d.tp_rank)
        and src.model.rope_pairing == dst_desc.model.rope_pairing
        and s.is_paged == d.is_paged
        and s.block_size == d.block_size
        and not (s.is_tiled or d.is_tiled)
        and all(layer.kind == ATTN for layer in src.model.layers)
    )


def _is_same_blocks(
    srcs: Sequence[CacheBuffers], outs: Sequence[CacheBuffers], dst_desc: Descriptor,
    num_tokens: int | None,
) -> bool:  # fmt: skip
    """Whether whole blocks move between two caches of one descriptor (`copy_blocks`)."""
    return (
        len(srcs) == len(outs) == 1
        and srcs[0].desc == dst_desc == outs[0].desc
        and dst_desc.layout.is_paged
        and (num_tokens is None or num_tokens % dst_desc.layout.block_size == 0)
        and can_copy(srcs[0])
        and can_copy(outs[0])
    )


def _check_sources(srcs: Sequence[CacheBuffers], dst_desc: Descriptor) -> Descriptor:
    if not srcs:
        raise IncompatibleError("no source shards given")
    first = srcs[0].desc
    for rank, s in enumerate(srcs):
        check_compatible(first.model, s.desc.model)
        lay = s.desc.layout
        if len(srcs) > 1 and (lay.tp_rank, lay.tp_size) != (rank, len(srcs)):
            raise IncompatibleError(
                f"source {rank} is TP shard {lay.tp_rank}/{lay.tp_size}; "
                f"expected {rank}/{len(srcs)} (give all shards in rank order)"
            )
    check_compatible(first.model, dst_desc.model)
    return first


def _dst_shards(srcs: Sequence[CacheBuffers], dst_desc: Descriptor) -> list[Descriptor]:
    size = dst_desc.layout.tp_size
    if len(srcs) == 1 and srcs[0].desc.layout.tp_size == size:
        return [dst_desc]
    if len(srcs) == 1 and srcs[0].desc.layout.tp_size != 1:
        raise IncompatibleError("resharding needs every source shard")
    return [dst_desc.with_layout(tp_rank=r) for r in range(size)]


def _dst_extent(layout: Layout, num_tokens: int, block_ids: Sequence[int] | None) -> int:
    if not layout.is_paged:
        return num_tokens
    if block_ids is not None:
        return max(block_ids) + 1
    return -(-num_tokens // layout.block_size)


def _reblock_runs(
    srcs: Sequence[CacheBuffers],
    out: CacheBuffers,
    num_tokens: int | None,
    src_ids: Sequence[int] | None,
    dst_ids: Sequence[int] | None,
) -> list[Run] | None:
    """The one-pass runs (reblock.py) of a conversion between unquantised paged layouts of
    other block sizes, or None where it goes another way."""
    s, d = srcs[0].desc.layout, out.desc.layout
    if num_tokens is None or s.block_size == d.block_size or not s.quant == d.quant == "none":
        return None
    if not (s.is_paged and _is_strided(srcs[0].desc, out.desc, len(srcs))):
        return None
    s_table = block_table_for(s, num_tokens, src_ids, srcs[0].extent).tolist()
    d_table = block_table_for(d, num_tokens, dst_ids, out.extent).tolist()
    return plan_runs(s.block_size, d.block_size, num_tokens, s_table, d_table)


def _is_direct(src: Descriptor, dst: Descriptor, num_srcs: int) -> bool:
    """Same values stored the same way, same shard, same blocks: a strided copy suffices."""
    return _is_strided(src, dst, num_srcs) and src.layout.block_size == dst.layout.block_size


def _is_strided(src: Descriptor, dst: Descriptor, num_srcs: int) -> bool:
    """Same values stored the same way and same shard, in blocks of any size: each layer's
    planes are strided `[B, N, H, C]` views of the same contents."""
    s, d = src.layout, dst.layout
    same_codec = (s.quant == d.quant == "none") or (
        (s.quant, s.dtype, s.scales, s.planes == "concat")
        == (d.quant, d.dtype, d.scales, d.planes == "concat")
    )
    return (
        num_srcs == 1
        and (s.tp_size, s.tp_rank) == (d.tp_size, d.tp_rank)
        and same_codec
        and src.model.rope_pairing == dst.model.rope_pairing
        and s.is_paged == d.is_paged
        and not (s.is_tiled or d.is_tiled)  # tiled views have no strided [B, N, H, C] form
    )


def _copy_direct(
    src_views: GroupViews,
    dst_views: GroupViews,
    whole: bool,
    num_tokens: int | None,
    src_desc: Descriptor,
    dst_desc: Descriptor,
    src_ids: Sequence[int] | None,
    dst_ids: Sequence[int] | None,
    pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Copy one layer's planes view to view; with `pending`, a whole cache's (dst, src) views
    are collected there instead (for a `CopyPlan`)."""
    raw = src_desc.layout.quant != "none"  # identical quantised records: copy them as they are
    pairs = (
        zip(src_views, dst_views, strict=True)
        if raw
        else zip(_plane_views(src_views), _plane_views(dst_views), strict=True)
    )
    for (_, sv), (_, dv) in pairs:
        if whole and pending is not None:
            pending.append((dv, sv))
        elif whole:
            dv.copy_(sv)
        elif not src_desc.layout.is_paged:
            dv[:, :num_tokens].copy_(sv[:, :num_tokens])
        else:
            s_ids = block_table_for(src_desc.layout, num_tokens, src_ids, sv.shape[0])
            d_ids = block_table_for(dst_desc.layout, num_tokens, dst_ids, dv.shape[0])
            dv[d_ids] = sv[s_ids].to(dv.dtype)


def _plane_views(groups: GroupViews) -> GroupViews:
    """Split packed (concat) groups into one view per plane, by content offset."""
    out = []
    for planes, view in groups:
        start = 0
        for p in planes:
            out.append(((p,), view[..., start : start + p.width]))
            start += p.width
    return out


def _copy_tokens(
    layer_id: int,
    srcs: Sequence[CacheBuffers],
    src_views: list[GroupViews],
    src_map: SlotMap,
    outs: Sequence[CacheBuffers],
    dst_views: list[GroupViews],
    dst_map: SlotMap,
) -> None:
    planes = _read_planes(layer_id, srcs, src_views, src_map, is_native=True)  # [T, H, width]
    src_pairing, dst_pairing = srcs[0].desc.model.rope_pairing, outs[0].desc.model.rope_pairing
    model = srcs[0].desc.model
    if "k" in planes and src_pairing != dst_pairing:
        planes["k"] = permute_pairing(planes["k"], src_pairing, dst_pairing, model.rope_dim)
    for out, views in zip(outs, dst_views, strict=True):
        lay = out.desc.layout
        for group, view in views:
            values = _cat(
                [_shard(planes[p.name], lay, model.layers[layer_id].kind) for p in group], dim=-1
            )
            encoded = encode(values, lay, layer_id, group)
            dst_map.scatter(view, encoded)


def _read_planes(
    layer_id: int,
    srcs: Sequence[CacheBuffers],
    src_views: list[GroupViews],
    src_map: SlotMap,
    is_native: bool = False,
) -> dict[str, torch.Tensor]:
    """`{plane: [T, heads, width]}` in float32, or with `is_native` in the stored dtype where
    that is exact (unquantised caches: encoding casts it as it would the float32 copy)."""
    shards: dict[str, list[torch.Tensor]] = {}
    is_attn = srcs[0].desc.model.layers[layer_id].kind == ATTN
    for src, views in zip(srcs if is_attn else srcs[:1], src_views, strict=False):
        for group, view in views:
            stored = src_map.gather(view)
            if not (is_native and src.desc.layout.quant == "none"):
                stored = decode(stored, src.desc.layout, layer_id, group)
            start = 0
            for p in group:
                shards.setdefault(p.name, []).append(stored[..., start : start + p.width])
                start += p.width
    return {name: _cat(parts, dim=1) for name, parts in shards.items()}


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _shard(values: torch.Tensor, layout: Layout, kind: str) -> torch.Tensor:
    if kind != ATTN or layout.tp_size == 1:
        return values
    per = values.shape[1] // layout.tp_size
    return values[:, layout.tp_rank * per : (layout.tp_rank + 1) * per]


def read_planes(
    cache: CacheBuffers, layer_id: int, num_tokens: int, block_ids: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """One layer's planes of a sequence as float32 `{name: [num_tokens, heads, width]}`."""
    views = [group_views(cache.desc, cache.tensors, layer_id)]
    per = cache.desc.model.layers[layer_id].rows_per_token
    slot_map = SlotMap.build(cache.desc.layout, num_tokens, block_ids, per=per)
    return _read_planes(layer_id, [cache], views, slot_map)
