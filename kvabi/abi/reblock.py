"""Re-blocking in one pass: whole blocks of one size moved into whole blocks of another, where
one size is a multiple of the other, as strided copies between views (no gather, no scatter).

A unit is `L = max(src, dst block size)` tokens: one block of the larger size and `r` blocks
of the smaller one, which must be consecutive in their table (else `plan_runs` gives None and
the caller goes token by token). Units whose blocks follow on both sides form one run; a run
of `n` units is one copy per plane between `[n, r, small, H, C]` views of the two caches (the
larger side's slot axis split in `r`, the smaller side's block axis split in `n, r`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (first src block, first dst block, units)
Run = tuple[int, int, int]


def plan_runs(
    src_block_size: int,
    dst_block_size: int,
    num_tokens: int,
    src_table: Sequence[int],
    dst_table: Sequence[int],
) -> list[Run] | None:
    """The runs moving `num_tokens` (whole units) from blocks `src_table` to `dst_table`, or
    None where this path does not apply (sizes not multiples, a partial unit, or a unit whose
    smaller blocks are not consecutive)."""
    big, small = max(src_block_size, dst_block_size), min(src_block_size, dst_block_size)
    if big % small or num_tokens % big or big == small:
        return None
    r, num_units = big // small, num_tokens // big
    s_per, d_per = big // src_block_size, big // dst_block_size  # blocks per unit, each side
    tables = (list(src_table[: num_units * s_per]), list(dst_table[: num_units * d_per]))
    if len(tables[0]) < num_units * s_per or len(tables[1]) < num_units * d_per:
        return None
    small_table, per = (tables[0], s_per) if s_per == r else (tables[1], d_per)
    for u in range(num_units):
        first = small_table[u * per]
        if small_table[u * per : (u + 1) * per] != list(range(first, first + per)):
            return None
    runs: list[Run] = []
    for u in range(num_units):
        s, d = tables[0][u * s_per], tables[1][u * d_per]
        if runs and (last := runs[-1])[0] + last[2] * s_per == s and last[1] + last[2] * d_per == d:
            runs[-1] = (last[0], last[1], last[2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def reblocked_pairs(
    src: torch.Tensor, dst: torch.Tensor, runs: list[Run]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(dst, src)` views `[n, r, small, H, C]` whose copies move the runs from canonical view
    `src` `[blocks, slots, H, C]` into `dst` (another block size)."""
    s_bs, d_bs = src.shape[1], dst.shape[1]
    big, small = max(s_bs, d_bs), min(s_bs, d_bs)
    r, pairs = big // small, []
    for s, d, n in runs:
        sv = _units(src[s : s + n * big // s_bs], n, r, s_bs == big)
        dv = _units(dst[d : d + n * big // d_bs], n, r, d_bs == big)
        pairs.append((dv, sv))
    return pairs


def _units(view: torch.Tensor, n: int, r: int, is_big: bool) -> torch.Tensor:
    """`view`'s blocks as `[n, r, small, H, C]` (a view, no copy)."""
    if is_big:  # [n, big, H, C]: split the slot axis
        return view.unflatten(1, (r, view.shape[1] // r))
    return view.unflatten(0, (n, r))  # [n * r, small, H, C]: split the block axis
