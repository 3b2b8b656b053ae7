"""The tensors a descriptor names, their shapes, and canonical views into them.

Every layout, whatever its physical axis order, yields for each (layer, plane group) a strided
view indexed `[block, slot, head, content]` (an unpaged cache: one block of all its tokens).
Conversion is copying between such views; presets never need code of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from kvabi.abi.axes import dim_of, part_sizes
from kvabi.abi.codec import stored_width, torch_dtype
from kvabi.abi.descriptor import (
    INDEXER,
    SHARED,
    STATE,
    Descriptor,
    LayerSpec,
    Layout,
    Plane,
)
from kvabi.abi.errors import MissingPlaneError, ShapeError
from kvabi.abi.indexer_record import record_bytes
from kvabi.abi.tiled_view import CanonicalView, canonical_view


@dataclass(frozen=True)
class BufferSpec:
    """One tensor of a cache: its key, the layers and planes it holds, and its shape."""

    key: str
    layer_ids: tuple[int, ...]
    planes: tuple[str, ...]
    axes: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def is_sidecar(self) -> bool:
        """A sidecar plane's buffer (an MLA layer's indexer keys, a centries layer's state),
        outside the layer's plane groups."""
        return self.planes in ((INDEXER,), (STATE,))

    def dim(self, letter: str) -> int:
        """The tensor dimension of axis `letter` (its outer part when tiled)."""
        return dim_of(self.axes, letter)


def owner_layers(desc: Descriptor) -> list[int]:
    """Layers that hold KV of their own (shared layers point at one of these)."""
    return [i for i, x in enumerate(desc.model.layers) if x.has_kv]


@lru_cache(maxsize=1024)
def buffer_specs(desc: Descriptor, extent: int) -> tuple[BufferSpec, ...]:
    """The buffers of a cache of `extent` blocks (paged) or tokens (unpaged), in key order.

    Cached: descriptors are frozen and hot paths (conversion, the engine) ask again and again."""
    lay, owners = desc.layout, owner_layers(desc)
    groups = [(owners, "all")] if lay.is_cross_layer else [([i], str(i)) for i in owners]
    specs = []
    for layer_ids, prefix in groups:
        layer = desc.model.layers[layer_ids[0]]
        planes = layer.planes
        if lay.planes == "separate":
            for p in planes:
                axes = lay.v_axes if (p.name == "v" and lay.v_axes) else lay.axes
                sizes = _sizes(desc, layer, (p,), extent, len(layer_ids))
                specs.append(_spec(f"{prefix}.{p.name}", layer_ids, (p.name,), axes, sizes, lay))
        else:
            sizes = _sizes(desc, layer, planes, extent, len(layer_ids))
            specs.append(
                _spec(prefix, layer_ids, tuple(p.name for p in planes), lay.axes, sizes, lay)
            )
        specs += [_sidecar_spec(desc, layer_ids[0], p, extent) for p in layer.sidecar_planes]
    return tuple(specs)  # immutable: every caller shares the cached value


@lru_cache(maxsize=4096)
def layer_buffer_specs(desc: Descriptor, layer_id: int, extent: int) -> tuple[BufferSpec, ...]:
    """The buffers holding one layer (for a per-layer layout: exactly that layer's tensors)."""
    return tuple(s for s in buffer_specs(desc, extent) if layer_id in s.layer_ids)


def allocate(desc: Descriptor, extent: int, fill: str = "empty") -> dict[str, torch.Tensor]:
    make = torch.zeros if fill == "zeros" else torch.empty
    return {s.key: make(s.shape, dtype=s.dtype) for s in buffer_specs(desc, extent)}


def infer_extent(desc: Descriptor, tensors: dict[str, torch.Tensor]) -> int:
    """Number of blocks (paged) or tokens (unpaged) the tensors hold, read off the first one."""
    first = buffer_specs(desc, 1)[0]
    if first.key not in tensors:
        raise ShapeError(
            f"buffer {first.key!r} is missing; the descriptor names "
            f"{[s.key for s in buffer_specs(desc, 1)]}"
        )
    return int(tensors[first.key].shape[first.dim("B" if desc.layout.is_paged else "T")])


def check_buffers(desc: Descriptor, tensors: dict[str, torch.Tensor]) -> int:
    """Raise ShapeError unless `tensors` are exactly the buffers `desc` names; return the extent."""
    extent = infer_extent(desc, tensors)
    specs = buffer_specs(desc, extent)
    extra = set(tensors) - {s.key for s in specs}
    if extra:
        raise ShapeError(f"buffers {sorted(extra)} are not in the descriptor")
    for s in specs:
        t = tensors.get(s.key)
        if t is None and s.is_sidecar:
            raise MissingPlaneError(s.layer_ids[0], s.planes[0], f"buffer {s.key!r} is missing")
        if t is None:
            raise ShapeError(f"buffer {s.key!r} is missing")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ShapeError(
                f"buffer {s.key!r}: descriptor says {list(s.shape)} {s.dtype}, "
                f"tensor is {list(t.shape)} {t.dtype}"
            )
    return extent


def group_views(
    desc: Descriptor, tensors: dict[str, torch.Tensor], layer_id: int
) -> list[tuple[tuple[Plane, ...], CanonicalView]]:
    """Per plane group of a layer: its planes and a view `[block, slot, head, stored content]`.

    The view is a strided tensor, or a `TiledView` when the layout splits N, H or C into tiles
    (docs/ABI.md 3.2); `tiled_view.gather` / `scatter` read and write either."""
    probe, dim = _extent_at(desc, layer_id)
    recipe = _group_recipe(desc, layer_id, tensors[probe].shape[dim])
    out = []
    for planes, key, selects, interior, axes in recipe:
        t = tensors[key]
        for dim, index in selects:
            t = t.select(dim, index)
        if interior:
            t = t.unflatten(-1, interior)
        out.append((planes, canonical_view(t, axes)))
    return out


@lru_cache(maxsize=4096)
def _extent_at(desc: Descriptor, layer_id: int) -> tuple[str, int]:
    """Which buffer of a layer, and which of its dims, holds its extent (B, or T unpaged)."""
    layers = desc.model.layers
    layer_id = layers[layer_id].shares if layers[layer_id].kind == SHARED else layer_id
    spec = next(s for s in layer_buffer_specs(desc, layer_id, 1) if not s.is_sidecar)
    return spec.key, spec.dim("B" if desc.layout.is_paged else "T")


@lru_cache(maxsize=4096)
def _group_recipe(desc: Descriptor, layer_id: int, extent: int) -> tuple:
    """How `group_views` cuts a layer's plane groups out of its buffers, worked out once per
    (descriptor, layer, extent): per group its planes, the buffer's key, the (dim, index)
    selections (its layer of a cross-layer buffer, its plane of a K axis), the interior's part
    sizes to unflatten (plane orders) and the axes left."""
    layers = desc.model.layers
    layer_id = layers[layer_id].shares if layers[layer_id].kind == SHARED else layer_id
    layer = layers[layer_id]
    out = []
    for spec in layer_buffer_specs(desc, layer_id, 1):
        if spec.is_sidecar:
            continue
        axes, selects = spec.axes, []
        planes = tuple(p for p in layer.planes if p.name in spec.planes)
        sizes = _sizes(desc, layer, planes, extent, len(spec.layer_ids))
        if "L" in axes:
            selects.append((spec.dim("L"), spec.layer_ids.index(layer_id)))
            axes = axes.replace("L", "")
        if "K" not in axes:
            out.append((planes, spec.key, tuple(selects), (), axes))
            continue
        for i, plane in enumerate(planes):
            own = _plane_order(desc.layout, axes, i).replace("K", "")
            interior: tuple[int, ...] = ()
            if desc.layout.has_plane_orders:  # [outer axes..., interior] -> its parts
                whole = part_sizes(own, sizes)
                interior = whole[dim_of(axes, "K") :]  # the parts after the K axis
            out.append(((plane,), spec.key, (*selects, (dim_of(axes, "K"), i)), interior, own))
    return tuple(out)


def _plane_order(lay: Layout, axes: str, plane_index: int) -> str:
    """The axis order of plane `plane_index` of a K-axis buffer (`axes` without L)."""
    return lay.v_axes.replace("L", "") if plane_index == 1 and lay.has_plane_orders else axes


def _sizes(
    desc: Descriptor, layer: LayerSpec, planes: tuple[Plane, ...], extent: int, num_layers: int
) -> dict[str, int]:
    lay = desc.layout
    heads = planes[0].num_heads // (lay.tp_size if layer.kind == "attn" else 1)
    width = stored_width(lay, planes) if lay.planes != "axis" else stored_width(lay, planes[:1])
    sizes = {"L": num_layers, "K": len(planes), "H": heads, "C": width}
    rows, tokens = layer.rows_per_token  # a centries layer: a row per `ratio` tokens
    if lay.is_paged:
        sizes |= {"B": extent, "N": lay.block_size * rows // tokens}
    else:
        sizes["T"] = extent
    return sizes


def _spec(
    key: str,
    layer_ids: list[int],
    planes: tuple[str, ...],
    axes: str,
    sizes: dict[str, int],
    lay: Layout,
) -> BufferSpec:
    shape = part_sizes(axes, sizes)
    if lay.has_plane_orders:  # K and V order their interiors apart: one flat dim after K
        k_dim = dim_of(axes, "K")
        shape = (*shape[: k_dim + 1], _numel(shape[k_dim + 1 :]))
    return BufferSpec(key, tuple(layer_ids), planes, axes, shape, torch_dtype(lay.dtype))


def _sidecar_spec(desc: Descriptor, layer_id: int, plane: Plane, extent: int) -> BufferSpec:
    """`"<layer>.indexer"`: u8 `[B, N * (D + 4)]` (paged; vLLM's block layout,
    `kvabi/abi/indexer_record.py`) or `[T, D + 4]` (unpaged: one record per token).
    `"<layer>.state"` (a centries layer with overlap): u8 `[B, state_bytes]`, one per block."""
    lay = desc.layout
    if plane.name == STATE:
        per_block = desc.model.layers[layer_id].state_bytes
    else:
        per_block = (lay.block_size if lay.is_paged else 1) * record_bytes(plane.width)
    axes = "BC" if lay.is_paged else "TC"
    key = f"{layer_id}.{plane.name}"
    return BufferSpec(key, (layer_id,), (plane.name,), axes, (extent, per_block), torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class CacheBuffers:
    """A cache's tensors with the descriptor that says what they are. Checked on construction."""

    desc: Descriptor
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        self.extent = check_buffers(self.desc, self.tensors)

    @classmethod
    def empty(cls, desc: Descriptor, extent: int, fill: str = "empty") -> CacheBuffers:
        return cls(desc, allocate(desc, extent, fill))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @cached_property
    def geometry(self) -> tuple:
        """Per buffer: its key, shape (the extent's dim as -1), strides and dtype: what
        conversions worked out once per geometry depend on (the tensors, once checked here,
        are never replaced)."""
        out = []
        for spec in buffer_specs(self.desc, 1):
            t, dim = self.tensors[spec.key], spec.dim("B" if self.desc.layout.is_paged else "T")
            shape = tuple(-1 if d == dim else n for d, n in enumerate(t.shape))
            out.append((spec.key, shape, t.stride(), t.dtype))
        return tuple(out)
