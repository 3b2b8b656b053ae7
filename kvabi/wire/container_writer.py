"""Writing containers, one layer at a time, to any binary sink (file, socket, buffer)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import BinaryIO, NamedTuple

import torch

from kvabi.abi.block_hash import token_array
from kvabi.abi.buffers import CacheBuffers, layer_buffer_specs, owner_layers
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.errors import MissingPlaneError, ShapeError
from kvabi.wire.container_format import (
    HASH_BYTES,
    TOKEN_BYTES,
    U64,
    Header,
    SectionLayout,
    checksum,
    desc_json,
    end_record,
    extent_for,
    padding,
    section_layouts,
)
from kvabi.wire.errors import ContainerError


class PreparedSection(NamedTuple):
    """One layer's payload checked against its layout, as byte views of its tensors (no copy)."""

    layout: SectionLayout
    parts: list[memoryview]


class ContainerWriter:
    """Streams a container: the meta on construction, then `write_layer` per owner layer in
    ascending order, then `close()` for the end record. Nothing is buffered beyond one layer's
    checksum pass; the sink is not closed.

    `prepare` + `write_prepared` split `write_layer` in two: a sender holding every layer at
    once prepares them all first, so the per-layer loop is only the checksum and the writes
    (each layer's bytes stream through the CPU caches and evict what the tensor calls need).
    """

    def __init__(
        self,
        sink: BinaryIO,
        desc: Descriptor,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] = (),
    ) -> None:
        if desc.layout.is_cross_layer:
            raise ContainerError(
                f"layout axes {desc.layout.axes!r} put several layers in one "
                "buffer; convert to a per-layer layout before writing"
            )
        tokens = token_array(token_ids)  # [num_tokens] u32 LE
        hashes = _checked_hashes(block_hashes)
        self.desc, self.num_bytes = desc, 0
        self.extent = extent_for(desc, len(tokens))
        self._sink = sink
        self._layouts = section_layouts(desc, len(tokens))
        self._by_layer = {x.layer_id: x for x in self._layouts}
        self._checksums: list[int] = []
        self._is_closed = False
        self._write_meta(tokens.tobytes(), hashes)

    def write_layer(self, layer_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write one owner layer's section; `tensors` are its buffers, keyed as the specs are."""
        self.write_prepared(self.prepare(layer_id, tensors))

    def prepare(self, layer_id: int, tensors: dict[str, torch.Tensor]) -> PreparedSection:
        """Owner layer `layer_id`'s section, checked, for `write_prepared` (in layer order)."""
        layout = self._by_layer.get(layer_id)
        if layout is None:
            raise ContainerError(
                f"layer {layer_id} is not an owner layer of the descriptor "
                f"({[x.layer_id for x in self._layouts]})"
            )
        if layout.first:  # a sliding layer's tail: the blocks its window still needs
            tensors = _tail(self.desc, layout, tensors)
        return PreparedSection(layout, _payload_parts(layout, tensors))

    def write_prepared(self, section: PreparedSection) -> None:
        """Write a section from `prepare`: checksum, header, payload."""
        layout = self._next_layout(section.layout.layer_id)
        section_sum = checksum(layout.head(), *section.parts)
        self._write(layout.header(section_sum), *section.parts)
        self._checksums.append(section_sum)

    def close(self) -> None:
        """Write the end record; every owner layer must have been written."""
        if self._is_closed:
            raise ContainerError("the container is already closed")
        if len(self._checksums) != len(self._layouts):
            missing = [x.layer_id for x in self._layouts[len(self._checksums) :]]
            raise ContainerError(f"close() before layers {missing} were written")
        record = end_record(self._checksums)
        self._sink.write(record)
        self.num_bytes += len(record)
        self._is_closed = True

    def _write_meta(self, tokens: bytes, hashes: bytes) -> None:
        desc_text = desc_json(self.desc)
        num_tokens, num_hashes = len(tokens) // TOKEN_BYTES, len(hashes) // HASH_BYTES
        header = Header.for_desc(
            self.desc, len(desc_text), num_tokens, num_hashes, len(self._layouts)
        )
        parts = (header.pack(), desc_text, tokens, hashes)
        self._write(*parts, U64.pack(checksum(*parts)))

    def _write(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self._sink.write(part)
            self.num_bytes += len(part)
        pad = padding(self.num_bytes)
        self._sink.write(bytes(pad))
        self.num_bytes += pad

    def _next_layout(self, layer_id: int) -> SectionLayout:
        done = len(self._checksums)
        if self._is_closed or done == len(self._layouts):
            raise ContainerError(f"write_layer({layer_id}): all {done} layers are written")
        expected = self._layouts[done].layer_id
        if layer_id != expected:
            raise ContainerError(
                f"write_layer({layer_id}): layer {expected} comes next (owner "
                f"layers, ascending: {[x.layer_id for x in self._layouts]})"
            )
        return self._layouts[done]


def write_container(
    dest: str | os.PathLike[str] | BinaryIO,
    cache: CacheBuffers,
    token_ids: Sequence[int],
    block_hashes: Sequence[bytes] = (),
) -> int:
    """Write `cache` holding `token_ids` as one container; return the number of bytes written.

    The cache may hold more blocks (or token slots) than the tokens need: only the first
    ceil(num_tokens / block_size) blocks (num_tokens token slots) are written.
    """
    if isinstance(dest, str | os.PathLike):
        with open(dest, "wb") as f:
            return write_container(f, cache, token_ids, block_hashes)
    writer = ContainerWriter(dest, cache.desc, token_ids, block_hashes)
    if cache.extent < writer.extent:
        raise ShapeError(
            f"{len(token_ids)} tokens need {writer.extent} blocks/slots, the cache "
            f"holds {cache.extent}"
        )
    for layer_id in owner_layers(cache.desc):
        writer.write_layer(layer_id, layer_tensors(cache, layer_id, writer.extent))
    writer.close()
    return writer.num_bytes


def container_bytes(
    cache: CacheBuffers, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
) -> bytes:
    """The container of `cache` as bytes (see `write_container`)."""
    sink = io.BytesIO()
    write_container(sink, cache, token_ids, block_hashes)
    return sink.getvalue()


def _checked_hashes(block_hashes: Sequence[bytes]) -> bytes:
    for i, h in enumerate(block_hashes):
        if not isinstance(h, bytes | bytearray) or len(h) != HASH_BYTES:
            raise ValueError(f"block_hashes: entry {i} is not a {HASH_BYTES}-byte hash: {h!r:.80}")
    return b"".join(block_hashes)


def layer_tensors(cache: CacheBuffers, layer_id: int, extent: int) -> dict[str, torch.Tensor]:
    """The buffers of one layer's section: views of `cache`'s first `extent` blocks/slots."""
    out = {}
    for spec in layer_buffer_specs(cache.desc, layer_id, extent):
        axis = spec.dim("B" if cache.desc.layout.is_paged else "T")
        out[spec.key] = cache.tensors[spec.key].narrow(axis, 0, extent)
    return out


def _tail(
    desc: Descriptor, layout: SectionLayout, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Whole-extent buffers narrowed to the section's blocks/slots (tail-sized ones as given)."""
    axis_letter = "B" if desc.layout.is_paged else "T"
    out = {}
    for key, t in tensors.items():
        spec = next((s for s in layout.specs if s.key == key), None)
        axis = spec.dim(axis_letter) if spec is not None else 0
        whole = spec is not None and t.dim() == len(spec.shape)
        if whole and t.shape[axis] == layout.first + spec.shape[axis]:
            t = t.narrow(axis, layout.first, spec.shape[axis])
        out[key] = t
    return out


def _payload_parts(layout: SectionLayout, tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """The payload as pieces: each buffer's bytes, preceded by the zeros that align it."""
    keys = [s.key for s in layout.specs]
    for spec in layout.specs:
        if spec.is_sidecar and spec.key not in tensors:
            raise MissingPlaneError(layout.layer_id, spec.planes[0], f"no buffer {spec.key!r}")
    if sorted(tensors) != sorted(keys):
        raise ShapeError(
            f"layer {layout.layer_id}: got buffers {sorted(tensors)}, the descriptor names {keys}"
        )
    parts, end = [], 0
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        t = tensors[spec.key]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ShapeError(
                f"layer {layout.layer_id} buffer {spec.key!r}: descriptor says "
                f"{list(spec.shape)} {spec.dtype}, tensor is {list(t.shape)} {t.dtype}"
            )
        if offset > end:
            parts.append(memoryview(bytes(offset - end)))
        if spec.num_bytes:
            parts.append(_byte_view(t))
        end = offset + spec.num_bytes
    return parts


def _byte_view(t: torch.Tensor) -> memoryview:
    """`t`'s bytes in row-major order: a view when it is a contiguous CPU tensor, else a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
