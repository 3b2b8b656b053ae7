"""The axis language of a layout: axis letters, optionally split into tiles (ABI 1.1).

An axis string lists a buffer's dimensions, outermost first. An upper-case letter is a whole
axis, or the outer part of a tiled one; a lower-case letter with a size is a tile of that axis:
`BHKNCn16c2` is `[B][H][K][N/16][C/2][16][2]`, slot `o = N_outer * 16 + n`, content
`d = C_outer * 2 + c`. Several tiles of one axis nest in the order written (docs/ABI.md 3.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from kvabi.abi.errors import DescriptorError

AXIS_LETTERS = "LKBNHCT"  # layer, plane (K/V), block, slot in block, head, content, token
TILEABLE = "NHC"  # axes of fixed size within a buffer that may be split into tiles
_TOKEN = re.compile(r"([A-Z])|([a-z])([1-9][0-9]*)|(.)")


@dataclass(frozen=True)
class AxisPart:
    """One dimension of a buffer: `letter`'s whole/outer part (`tile == 0`) or a tile of it."""

    letter: str
    tile: int = 0

    @property
    def text(self) -> str:
        return self.letter if not self.tile else f"{self.letter.lower()}{self.tile}"


@lru_cache(maxsize=512)
def parse_axes(axes: str, field_name: str = "axes") -> tuple[AxisPart, ...]:
    """Split an axis string into its parts; refuses unknown letters, repeats and bad tiles."""
    parts = []
    for match in _TOKEN.finditer(axes):
        whole, tile_letter, tile, junk = match.groups()
        if junk is not None or (whole and whole not in AXIS_LETTERS):
            raise DescriptorError(f"{field_name}: {axes!r} has an unknown axis token at {junk!r}")
        if whole:
            parts.append(AxisPart(whole))
            continue
        letter = tile_letter.upper()
        if letter not in TILEABLE or int(tile) < 2:
            raise DescriptorError(
                f"{field_name}: {axes!r}: tile {tile_letter}{tile} must split one of "
                f"{TILEABLE} into tiles of >= 2"
            )
        parts.append(AxisPart(letter, int(tile)))
    _check_parts(axes, field_name, parts)
    return tuple(parts)


def _check_parts(axes: str, field_name: str, parts: list[AxisPart]) -> None:
    letters = [p.letter for p in parts if not p.tile]
    if len(set(letters)) != len(letters):
        raise DescriptorError(
            f"{field_name}: {axes!r} must use each of {AXIS_LETTERS} at most once"
        )
    for p in parts:
        if p.tile and p.letter not in letters:
            raise DescriptorError(
                f"{field_name}: {axes!r}: tile {p.text} needs its axis {p.letter} (the outer part)"
            )


def plain_letters(axes: str) -> str:
    """The axis letters without tiles, in order: `BHKNCn16c2` -> `BHKNC`."""
    return "".join(p.letter for p in parse_axes(axes) if not p.tile)


def tile_product(axes: str, letter: str) -> int:
    """The product of `letter`'s tiles (1 when untiled): the axis size must be a multiple."""
    return prod(p.tile for p in parse_axes(axes) if p.tile and p.letter == letter)


def has_tiles(axes: str) -> bool:
    return any(p.tile for p in parse_axes(axes))


def part_sizes(axes: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """Each part's size given the whole axes' sizes: the outer part is size / tile product."""
    return tuple(
        p.tile if p.tile else sizes[p.letter] // tile_product(axes, p.letter)
        for p in parse_axes(axes)
    )


def dim_of(axes: str, letter: str) -> int:
    """The dimension index of `letter`'s whole/outer part in a buffer with these axes."""
    for i, p in enumerate(parse_axes(axes)):
        if p.letter == letter and not p.tile:
            return i
    raise DescriptorError(f"axes {axes!r} have no axis {letter}")
