"""`ReblockPlan`: a re-blocking conversion's copies worked out once per geometry, so that a
conversion is a few kernel calls, not Python per layer.

Re-blocking (reblock.py) moves runs of whole units between blocks of two sizes, one strided
copy per layer, plane and run between `[n, r, small, H, C]` views. Building those views took
about 1.5 ms per conversion of SmolLM2's 30 layers (vLLM's connector loading a 640-token hit:
as long as the copies themselves). Every layer's views have the same shape and strides; they
differ only in their buffer and in where in it they start, and a run only moves their start
by whole units. So the plan builds each pair once for one unit at block 0, keeps its strides
and its offsets into its buffers, and a conversion adds the buffers' addresses and each run's
first blocks (numpy, for every pair and run at once) and hands the copies to the kernels: those
that transpose 2-byte elements to `kvabi_transpose_views`, the rest (rows contiguous on both
sides) to `kvabi_copy_views`. A pair that is neither, a tiled layout, a sidecar plane, no
kernels, or transposes where the kernels only have an element loop for them: no plan (the
caller goes view by view, by torch's `copy_`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvabi.abi.buffers import CacheBuffers, group_views, owner_layers
from kvabi.abi.reblock import Run, reblocked_pairs
from kvabi.abi.view_copy import (
    COPY,
    COPY_DIMS,
    SPEC_WIDTH,
    TRANSPOSE_WIDTH,
    _locate,
    transpose_template,
)
from kvabi.native.cpu_kernels import cpu_kernels

_MAX_PLANS = 64


@dataclass(frozen=True)
class _Pairs:
    """One kind of copy (row copies or transposes), every pair of it: spec templates whose
    address columns hold offsets into the buffers, and what a run adds to them."""

    specs: np.ndarray  # int64 [pairs, width]: addresses as byte offsets into their buffers
    dst_buffer: np.ndarray  # int64 [pairs]: which of the plan's dst buffers
    src_buffer: np.ndarray
    dst_block: np.ndarray  # int64 [pairs]: bytes from one dst block to the next
    src_block: np.ndarray
    layer: np.ndarray  # int64 [pairs]: the layer each pair moves
    n_col: int  # the spec column holding the units' count (the outermost dim)

    def for_runs(
        self, runs: Sequence[Run], dst_ptrs: np.ndarray, src_ptrs: np.ndarray,
        layer_ids: Sequence[int] | None,
    ) -> np.ndarray:  # fmt: skip
        """The specs of every pair (of `layer_ids`' layers, default all) for every run (first
        src block, first dst block, units), with absolute addresses."""
        keep = slice(None) if layer_ids is None else np.isin(self.layer, list(layer_ids))
        base, out = self.specs[keep], []
        dst = dst_ptrs[self.dst_buffer[keep]]
        src = src_ptrs[self.src_buffer[keep]]
        for s, d, n in runs:
            specs = base.copy()
            specs[:, 0] += dst + d * self.dst_block[keep]
            specs[:, 1] += src + s * self.src_block[keep]
            specs[:, self.n_col] = n
            out.append(specs)
        return np.concatenate(out) if out else base[:0]


class ReblockPlan:
    def __init__(self, dst_names: tuple, src_names: tuple, rows: _Pairs, transposes: _Pairs):
        self.dst_names, self.src_names = dst_names, src_names
        self.rows, self.transposes = rows, transposes

    def run(
        self, src: CacheBuffers, out: CacheBuffers, runs: Sequence[Run],
        layer_ids: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """Move the runs' blocks of `layer_ids`' layers (default all) from `src` into `out`
        (caches of the plan's geometry)."""
        kernels = cpu_kernels()
        dst_ptrs = np.asarray([out.tensors[k].data_ptr() for k in self.dst_names], np.int64)
        src_ptrs = np.asarray([src.tensors[k].data_ptr() for k in self.src_names], np.int64)
        for pairs, call in ((self.rows, "copy_views"), (self.transposes, "transpose_views")):
            specs = pairs.for_runs(runs, dst_ptrs, src_ptrs, layer_ids)
            if len(specs):
                getattr(kernels, call)(torch.from_numpy(np.ascontiguousarray(specs)))


_PLANS: dict[tuple, ReblockPlan | None] = {}


def reblock_plan(src: CacheBuffers, out: CacheBuffers) -> ReblockPlan | None:
    """The plan of re-blocking conversions from caches of `src`'s geometry into `out`'s (their
    extents aside), or None where there is none."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    key = (src.desc, out.desc, src.geometry, out.geometry)
    if key not in _PLANS:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = _build(src, out)
    plan = _PLANS[key]
    if plan is not None and len(plan.transposes.specs) and not kernels.transposes_fast:
        return None  # torch's strided copy beats an element loop
    return plan


def _build(src: CacheBuffers, out: CacheBuffers) -> ReblockPlan | None:
    s_bs, d_bs = src.desc.layout.block_size, out.desc.layout.block_size
    big = max(s_bs, d_bs)
    if src.extent < big // s_bs or out.extent < big // d_bs:
        return None  # the templates are built over one unit
    if any(layer.sidecar_planes for layer in src.desc.model.layers):
        return None
    dst_names, src_names = tuple(out.tensors), tuple(src.tensors)
    kinds: dict[str, list] = {"rows": [], "transposes": []}
    for layer_id in owner_layers(src.desc):
        planes = zip(
            _plain(group_views(src.desc, src.tensors, layer_id)),
            _plain(group_views(out.desc, out.tensors, layer_id)),
            strict=True,
        )
        for sv, dv in planes:
            if sv is None or dv is None:
                return None
            (dst, src_view), = reblocked_pairs(sv, dv, [(0, 0, 1)])  # fmt: skip
            # one unit's stride, from the block axis: torch's view of a size-1 dim may show any
            units = (dv.stride(0) * (big // d_bs), sv.stride(0) * (big // s_bs))
            entry = _pair(dst, src_view, units, out.tensors, src.tensors, dst_names, src_names)
            if entry is None:
                return None
            kind, spec, d_buf, s_buf = entry
            blocks = (dv.stride(0) * dv.element_size(), sv.stride(0) * sv.element_size())
            kinds[kind].append((spec, d_buf, s_buf, *blocks, layer_id))
    rows = _pairs(kinds["rows"], SPEC_WIDTH, n_col=3)
    transposes = _pairs(kinds["transposes"], TRANSPOSE_WIDTH, n_col=3)
    return ReblockPlan(dst_names, src_names, rows, transposes)


def _plain(groups: list) -> list[torch.Tensor | None]:
    """Each plane's canonical view (None for a tiled one: no plan)."""
    from kvabi.abi.convert import _plane_views  # convert imports this module

    return [v if isinstance(v, torch.Tensor) else None for _, v in _plane_views(groups)]


def _pair(dst, src, units, dst_bufs, src_bufs, dst_names, src_names):
    """(kind, spec template, dst buffer, src buffer) of one `[1, r, small, H, C]` pair whose
    first dim (n, set per run) steps `units` elements (dst, src), or None."""
    d_name, d_off = _locate(dst, dst_bufs)
    s_name, s_off = _locate(src, src_bufs)
    if d_name is None or s_name is None or dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    buffers = dst_names.index(d_name), src_names.index(s_name)
    size = dst.element_size()
    sizes, d_str, s_str = list(dst.shape), list(dst.stride()), list(src.stride())
    d_str[0], s_str[0] = units
    if d_str[-1] == 1 and s_str[-1] == 1:  # rows (C) contiguous on both sides
        outer = list(range(dst.dim() - 1))
        if len(outer) > COPY_DIMS:
            return None
        pad = COPY_DIMS - len(outer)
        spec = [d_off, s_off, len(outer), *[sizes[d] for d in outer], *[1] * pad,
                *[size * d_str[d] for d in outer], *[0] * pad,
                *[size * s_str[d] for d in outer], *[0] * pad,
                sizes[-1] * size, COPY, 0]  # fmt: skip
        return "rows", spec, *buffers
    if size != 2:
        return None
    template = transpose_template(tuple(sizes), tuple(d_str), tuple(sizes), tuple(s_str))
    if template is None:
        return None
    return "transposes", [d_off, s_off, *template], *buffers


def _pairs(entries: list, width: int, n_col: int) -> _Pairs:
    specs = np.asarray([e[0] for e in entries], dtype=np.int64).reshape(-1, width)
    cols = [np.asarray([e[i] for e in entries], dtype=np.int64) for i in range(1, 6)]
    return _Pairs(specs, *cols, n_col=n_col)
