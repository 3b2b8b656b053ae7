"""The layout half of a descriptor: how a KV cache's bytes are arranged (`Layout`).

Axis order as data, block size, storage dtype, quantisation, plane placement, TP shard; validated
at construction with errors naming the field (docs/ABI.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.abi.axes import (
    AXIS_LETTERS,  # noqa: F401 - re-exported
    has_tiles,
    parse_axes,
    plain_letters,
    tile_product,
)
from kvabi.abi.errors import DescriptorError

DTYPES = ("f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "u8")
QUANTS = (
    "none",
    "per_tensor",
    "per_token_head",
    "fp8_ds_mla",
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
)
GGML_QUANTS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
PLANE_PLACEMENTS = ("axis", "concat", "separate")
RECORD_SAFE_QUANTS = ("none", "per_tensor")  # element-wise: C may be anywhere, even tiled


def field_error(field_name: str, message: str) -> DescriptorError:
    return DescriptorError(f"{field_name}: {message}")


@dataclass(frozen=True)
class Layout:
    """How the bytes are laid out.

    `axes`: physical axis order, outermost first, over L (layer), K (plane), B (block),
    N (slot in block), H (head), C (content) -- or T (token) instead of B and N for an unpaged
    cache. Without K, `planes` says whether the planes are packed into C (`concat`) or held in
    separate buffers (`separate`, where V may have its own order `v_axes`). With K, `v_axes`
    may reorder V's part of the buffer after the K axis (ABI 1.1). N, H and C may be split into
    tiles (`BHKNCn16c2`, ABI 1.1; kvabi/abi/axes.py).
    """

    axes: str
    block_size: int = 0  # 0 only for an unpaged (T) layout
    dtype: str = "bf16"
    quant: str = "none"
    planes: str = "axis"
    v_axes: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    scales: tuple[float, ...] = ()  # per_tensor: (k, v) scale per layer, flattened
    name: str = ""  # the preset it came from, informational

    def __post_init__(self) -> None:
        object.__setattr__(self, "scales", tuple(float(s) for s in self.scales))
        self._check_axes(self.axes, "axes")
        if self.v_axes:
            self._check_v_axes()
        if self.is_paged and self.block_size < 1:
            raise field_error(
                "block_size", f"must be >= 1 for a paged layout, got {self.block_size}"
            )
        if not self.is_paged and self.block_size != 0:
            raise field_error("block_size", "an unpaged (T) layout has no block size; use 0")
        if self.dtype not in DTYPES:
            raise field_error("dtype", f"{self.dtype!r}; expected one of {DTYPES}")
        if self.quant not in QUANTS:
            raise field_error("quant", f"{self.quant!r}; expected one of {QUANTS}")
        if self.planes not in PLANE_PLACEMENTS:
            raise field_error("planes", f"{self.planes!r}; expected one of {PLANE_PLACEMENTS}")
        if ("K" in self.axes) != (self.planes == "axis"):
            raise field_error("planes", "'axis' if and only if K is one of the axes")
        if not 0 <= self.tp_rank < self.tp_size:
            raise field_error("tp_rank", f"rank {self.tp_rank} outside [0, {self.tp_size})")
        self._check_quant()

    def _check_axes(self, axes: str, name: str) -> None:
        parse_axes(axes, name)  # letters, repeats, tile tokens
        core = set(plain_letters(axes)) - {"L", "K"}
        if core not in ({"B", "N", "H", "C"}, {"T", "H", "C"}):
            raise field_error(name, f"{axes!r} needs B, N, H, C (paged) or T, H, C (unpaged)")
        if not axes.endswith("C") and self.quant not in RECORD_SAFE_QUANTS:
            raise field_error(name, f"{axes!r}: quantised records need C innermost, untiled")
        if has_tiles(axes) and self.planes == "concat" and tile_product(axes, "C") > 1:
            raise field_error(name, f"{axes!r}: planes packed into C (concat) cannot tile C")
        if "N" in core and self.block_size % tile_product(axes, "N"):
            raise field_error(
                name,
                f"{axes!r}: N tiles of {tile_product(axes, 'N')} slots do not divide "
                f"block_size {self.block_size}",
            )

    def _check_v_axes(self) -> None:
        self._check_axes(self.v_axes, "v_axes")
        if ("L" in self.v_axes) != ("L" in self.axes):
            raise field_error("v_axes", "K and V must agree on whether layers share a buffer")
        if self.planes == "concat":
            raise field_error("v_axes", "planes packed into C (concat) share one order")
        if sorted(plain_letters(self.v_axes)) != sorted(plain_letters(self.axes)):
            raise field_error(
                "v_axes",
                f"{self.v_axes!r} has other axes than {self.axes!r} (V's order is a "
                "permutation of K's axes)",
            )
        if self.planes == "axis":
            k_prefix, _, k_rest = self.axes.partition("K")
            v_prefix, _, v_rest = self.v_axes.partition("K")
            if k_prefix != v_prefix or "K" not in self.v_axes:
                raise field_error(
                    "v_axes",
                    f"{self.v_axes!r}: with a K axis, V's order may differ only after K "
                    f"(K's is {self.axes!r})",
                )
            if sorted(plain_letters(k_rest)) != sorted(plain_letters(v_rest)):
                raise field_error("v_axes", f"{self.v_axes!r} and {self.axes!r} differ in axes")

    def _check_quant(self) -> None:
        q, dt = self.quant, self.dtype
        allowed = {
            "none": DTYPES[:3],
            "per_tensor": ("fp8_e4m3", "fp8_e5m2"),
            "per_token_head": ("int8", "fp8_e4m3", "fp8_e5m2"),
        }.get(q, ("u8",))
        if dt not in allowed:
            raise field_error("dtype", f"quant {q!r} stores {'/'.join(allowed)}, not {dt!r}")
        if self.scales and q != "per_tensor":
            raise field_error(
                "scales", "only per_tensor quantisation keeps scales in the descriptor"
            )

    @property
    def is_paged(self) -> bool:
        return "T" not in self.axes

    @property
    def is_cross_layer(self) -> bool:
        return "L" in self.axes

    @property
    def is_tiled(self) -> bool:
        return has_tiles(self.axes) or has_tiles(self.v_axes)

    @property
    def has_plane_orders(self) -> bool:
        """One buffer holds K and V (a K axis) with V ordered apart after the K axis."""
        return bool(self.v_axes) and self.planes == "axis"

    @property
    def min_version(self) -> tuple[int, int]:
        """The lowest ABI version with every feature this layout uses (1.1: tiles, plane orders)."""
        return (1, 1) if self.is_tiled or self.has_plane_orders else (1, 0)
