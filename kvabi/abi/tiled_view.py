"""Canonical `[block, slot, head, content]` access to a plane group, tiled or not.

An untiled buffer's canonical view is a strided tensor (a permutation of its axes). A tiled one
(`BHKNCn16c2`: slot = outer * 16 + tile index) is not affine in the slot, so no strided 4-D view
exists; `TiledView` keeps the split axes `[B, N parts, H parts, C parts]` as a strided view and
maps a (block, slot) to its parts. Both kinds are read with `gather` and written with `scatter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch

from kvabi.abi.axes import AxisPart, parse_axes


@dataclass(frozen=True)
class TiledView:
    """A plane group's canonical view with N, H and C each split into parts, outermost first."""

    split: torch.Tensor  # [B, *n_parts, *h_parts, *c_parts], a strided view of the buffer
    n_parts: tuple[int, ...]
    h_parts: tuple[int, ...]
    c_parts: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (
            self.split.shape[0],
            prod(self.n_parts),
            prod(self.h_parts),
            prod(self.c_parts),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.split.dtype

    def slot_index(self, block_ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The split view's index of (block, slot) pairs: the block, then each N part's digit."""
        digits, rest = [], slots
        for size in reversed(self.n_parts):
            digits.append(rest % size)
            rest = rest // size
        return (block_ids, *reversed(digits))


CanonicalView = torch.Tensor | TiledView


def canonical_view(t: torch.Tensor, axes: str) -> CanonicalView:
    """The view `[B, N, H, C]` (unpaged `[1, T, H, C]`) of `t`, whose dims are `axes`' parts."""
    order, groups, is_unpaged = _recipe(axes)
    view = t.permute(order)
    if is_unpaged:
        view = view.unsqueeze(0)  # one block of all the tokens
    if all(len(g) == 1 for g in groups):  # no tiles: already [B, N, H, C]
        return view
    n_parts, h_parts, c_parts = (tuple(t.shape[d] for d in g) for g in groups)
    return TiledView(view, n_parts, h_parts, c_parts)


@lru_cache(maxsize=1024)
def _recipe(axes: str) -> tuple[list[int], tuple[tuple[int, ...], ...], bool]:
    """`canonical_view`'s permutation of `axes`' dims, the dims of the slot, head and content
    parts, and whether it is unpaged (asked per layer of every conversion: parsed once)."""
    parts = parse_axes(axes)
    slot = "N" if "N" in axes else "T"
    groups = tuple(tuple(_dims_of(parts, letter)) for letter in (slot, "H", "C"))
    block = [_dims_of(parts, "B")[0]] if slot == "N" else []
    return block + [d for g in groups for d in g], groups, slot == "T"


def _dims_of(parts: tuple[AxisPart, ...], letter: str) -> list[int]:
    """The dims of `letter`'s parts, most significant first: the outer part, then its tiles."""
    dims = [i for i, p in enumerate(parts) if p.letter == letter]
    return sorted(dims, key=lambda i: parts[i].tile != 0)


def gather(view: CanonicalView, block_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The stored content of tokens at (block_ids[t], slots[t]): `[T, H, C]` (a copy)."""
    if isinstance(view, torch.Tensor):
        return view[block_ids, slots]
    _, _, heads, width = view.shape
    return view.split[view.slot_index(block_ids, slots)].reshape(len(slots), heads, width)


def scatter(
    view: CanonicalView, block_ids: torch.Tensor, slots: torch.Tensor, values: torch.Tensor
) -> None:
    """Store `values` `[T, H, C]` at (block_ids[t], slots[t]) in place."""
    if isinstance(view, torch.Tensor):
        view[block_ids, slots] = values
        return
    parts = values.reshape(len(slots), *view.h_parts, *view.c_parts).to(view.dtype)
    view.split[view.slot_index(block_ids, slots)] = parts


MAX_RUNS = 16  # more runs of consecutive blocks than this: one index op instead of slices


def gather_blocks(
    view: CanonicalView, table: torch.Tensor, runs: list[range] | None = None
) -> torch.Tensor:
    """The stored content of whole blocks `table`, in order: `[len(table) * N, H, C]` (a view
    where the blocks are one run of a contiguous view, else a copy). `runs`: `table`'s runs
    of consecutive blocks (`block_runs`), when known."""
    blocks, slots, heads, width = view.shape
    stored = view if isinstance(view, torch.Tensor) else view.split
    runs = block_runs(table) if runs is None else runs
    if len(runs) <= MAX_RUNS:  # slices: no index kernel
        parts = [stored[r.start : r.stop] for r in runs]
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        whole = stored[table]
    return whole.reshape(-1, heads, width)


def scatter_blocks(
    view: CanonicalView, table: torch.Tensor, values: torch.Tensor,
    runs: list[range] | None = None,
) -> None:  # fmt: skip
    """Store `values` `[len(table) * N, H, C]` into whole blocks `table`, in place: a strided
    copy per run of consecutive blocks (PyTorch's index_put moves 16-bit elements about ten
    times slower), one index_put when the runs are many."""
    if isinstance(view, torch.Tensor):
        stored, parts = view, values.reshape(len(table), *view.shape[1:])
    else:
        stored = view.split
        parts = values.reshape(len(table), *view.n_parts, *view.h_parts, *view.c_parts)
    parts = parts.to(view.dtype)
    runs = block_runs(table) if runs is None else runs
    if len(runs) > MAX_RUNS:
        stored[table] = parts
        return
    start = 0
    for run in runs:
        stored[run.start : run.stop].copy_(parts[start : start + len(run)])
        start += len(run)


def block_runs(table: torch.Tensor) -> list[range]:
    """A block table as maximal runs of consecutive blocks, in order."""
    runs: list[range] = []
    for i in table.tolist():
        if runs and runs[-1].stop == i:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs
