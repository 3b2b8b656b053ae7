"""Reading and writing containers: one sequence's cache as a file or a byte stream.

The writer streams a layer at a time; `read_container` maps a file and returns zero-copy tensor
views after verifying every checksum; `iter_layers` yields each layer as its section arrives
(into a caller's buffer, when given one, with the tensors zero-copy views of it).
Byte layout: kvabi/wire/container_format.py and docs/ABI.md, section 5.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import BinaryIO, NamedTuple

import numpy as np
import torch
import xxhash

from kvabi.abi.buffers import CacheBuffers, owner_layers
from kvabi.abi.compat import check_compatible
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.wire.container_format import (
    END,
    HASH_BYTES,
    HEADER,
    SECTION_HEAD_CHECKED,
    SECTION_HEADER,
    TOKEN_BYTES,
    U64,
    Header,
    SectionLayout,
    check_end,
    check_section_header,
    checksum,
    checksum_state,
    extent_for,
    padding,
    section_layouts,
)
from kvabi.wire.errors import ChecksumError, FormatError, TruncatedError

PathLike = str | os.PathLike[str]
_READ_CHUNK = 1 << 26  # a stream reader grows its buffer by at most this much before data arrives


@dataclass(frozen=True)
class ContainerMeta:
    """Everything before the sections, verified: header, descriptor, token ids, block hashes."""

    header: Header
    desc: Descriptor
    token_ids: list[int]
    block_hashes: list[bytes]

    @property
    def extent(self) -> int:
        return extent_for(self.desc, len(self.token_ids))


class LayerSection:
    """One verified section: the layer and its buffers (keys as in `layer_buffer_specs`), as
    views of the payload made when first asked for. A receiver can take them after its
    receive loop: each layer's bytes pass through the CPU caches and evict what the tensor
    calls need, so making them inside the loop costs several times as much."""

    __slots__ = ("layer_id", "_layout", "_payload", "_tensors")

    def __init__(self, layer_id: int, layout: SectionLayout, payload: memoryview) -> None:
        self.layer_id, self._layout, self._payload = layer_id, layout, payload
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = _tensors(self._layout, self._payload)
        return self._tensors

    def __iter__(self) -> Iterator[object]:  # `layer_id, tensors = section`
        return iter((self.layer_id, self.tensors))


@dataclass(eq=False)
class Container:
    """A read container: the sequence's tokens and block hashes and its cache buffers."""

    desc: Descriptor
    token_ids: list[int]
    block_hashes: list[bytes]
    cache: CacheBuffers


def read_container(
    source: PathLike | bytes | bytearray | memoryview, expect: ModelSpec | None = None
) -> Container:
    """Read and verify a whole container; its tensors are views into the (mapped) input.

    A path is memory-mapped copy-on-write: tensors are zero-copy views of the file and writing
    to them never touches it. A bytearray or writable memoryview is viewed in place; read-only
    bytes are copied once. Nothing is returned unless every check passes.
    """
    src = _BufferSource(_as_buffer(source))
    meta = _read_meta(src, expect)
    sections = [
        _read_section(src, layout, i)
        for i, layout in enumerate(
            section_layouts(meta.desc, len(meta.token_ids), meta.header.flags)
        )
    ]
    check_end(src.take(END.size, "end record"), [s.checksum for s in sections])
    if src.remaining:
        raise FormatError(f"{src.remaining} bytes follow the end record at byte {src.pos}")
    tensors: dict[str, torch.Tensor] = {}
    for section in sections:
        tensors |= _tensors(section.layout, section.payload)
    return Container(meta.desc, meta.token_ids, meta.block_hashes, CacheBuffers(meta.desc, tensors))


def iter_layers(
    stream: BinaryIO, expect: ModelSpec | None = None, into: memoryview | None = None
) -> Iterator[ContainerMeta | LayerSection]:
    """Yield the verified ContainerMeta, then a LayerSection per section as it arrives.

    Each section's checksum is verified before it is yielded; the end record is checked when
    the iterator is exhausted (consume it fully). The stream is left just after the end record.
    With `into` (a writable buffer of exactly the container's size, known from its header),
    the stream is read ahead into it in as few reads as the stream allows and the tensors are
    views of it; a container that would not fit is refused (TruncatedError), never grown.
    Without it, each record gets its own buffer and only what it needs is read.
    """
    src = _StreamSource(stream) if into is None else _ReadAheadSource(stream, into)
    meta = _read_meta(src, expect)
    yield meta
    checksums = []
    layouts = section_layouts(meta.desc, len(meta.token_ids), meta.header.flags)
    if isinstance(src, _ReadAheadSource):
        src.follow(layouts)
    for index, layout in enumerate(layouts):
        section = _read_section(src, layout, index)
        checksums.append(section.checksum)
        yield LayerSection(layout.layer_id, layout, section.payload)
    check_end(src.take(END.size, "end record"), checksums)


class _BufferSource:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining:
            raise TruncatedError(
                f"the {what} needs bytes {self.pos}..{self.pos + n}, the "
                f"container ends at byte {len(self.data)}"
            )
        self.pos += n
        return self.data[self.pos - n : self.pos]


class _StreamSource:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.pos = stream, 0

    def take(self, n: int, what: str) -> memoryview:
        buf = bytearray(min(n, _READ_CHUNK))  # grown as data arrives: a corrupt length is cheap
        filled = 0
        while filled < n:
            if filled == len(buf):
                buf.extend(bytes(min(n - filled, len(buf), _READ_CHUNK)))
            got = self.stream.readinto(memoryview(buf)[filled:])
            if not got:
                raise TruncatedError(
                    f"the {what} needs bytes {self.pos}..{self.pos + n}, the "
                    f"stream ended at byte {self.pos + filled}"
                )
            filled += got
        self.pos += n
        return memoryview(buf)


class _ReadAheadSource:
    """Reads ahead into the caller's buffer. Once the sections' places are known (`follow`),
    each section's checksum is computed as its bytes arrive, while they are still in the CPU
    caches, instead of in a second pass over the whole payload (`section_sum`)."""

    def __init__(self, stream: BinaryIO, buffer: memoryview) -> None:
        self.stream, self.buffer = stream, buffer.cast("B")
        self.pos = self.filled = 0
        self._ranges: list[tuple[int, int, int]] = []  # (start, end, section), ascending
        self._states: list[xxhash.xxh3_64] = []
        self._sums: dict[int, int] = {}
        self._next = self._hashed = 0

    def follow(self, layouts: tuple[SectionLayout, ...]) -> None:
        """Hash each section's checked bytes (head, payload) as they arrive; call it with the
        reader at the first section's header."""
        at = self.pos
        for i, layout in enumerate(layouts):
            payload = at + SECTION_HEADER.size
            end = payload + layout.payload_len
            self._ranges += [(at, at + SECTION_HEAD_CHECKED, i), (payload, end, i)]
            self._states.append(checksum_state())
            at = end + padding(end)

        self._hash_arrived()

    def section_sum(self, index: int) -> int | None:
        """Section `index`'s checksum if it was computed on arrival."""
        return self._sums.get(index)

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buffer):
            raise TruncatedError(
                f"the {what} needs bytes {self.pos}..{end}, the container's "
                f"{len(self.buffer)} bytes end first"
            )
        while self.filled < end:  # read ahead: whatever has arrived, up to the container's end
            got = self.stream.readinto(self.buffer[self.filled :])
            if not got:
                raise TruncatedError(
                    f"the {what} needs bytes {self.pos}..{end}, the stream ended at byte "
                    f"{self.filled}"
                )
            self.filled += got
            self._hash_arrived()
        self.pos = end
        return self.buffer[end - n : end]

    def _hash_arrived(self) -> None:
        while self._next < len(self._ranges):
            start, end, index = self._ranges[self._next]
            if self.filled <= start and start < end:
                return
            lo, hi = max(start, self._hashed), min(end, self.filled)
            if hi > lo:
                self._states[index].update(self.buffer[lo:hi])
                self._hashed = hi
            if hi < end:
                return
            self._next += 1
            if self._next == len(self._ranges) or self._ranges[self._next][2] != index:
                self._sums[index] = self._states[index].intdigest()


_Source = _BufferSource | _StreamSource | _ReadAheadSource


class _Section(NamedTuple):
    layout: SectionLayout
    payload: memoryview  # verified against its checksum
    checksum: int


def _as_buffer(source: PathLike | bytes | bytearray | memoryview) -> memoryview:
    if isinstance(source, str | os.PathLike):
        return _map_file(source)
    view = memoryview(source)
    if view.readonly or not view.c_contiguous:
        return memoryview(bytearray(view))  # tensors must not alias immutable memory
    return view.cast("B")


def _map_file(path: PathLike) -> memoryview:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))


def _read_meta(src: _Source, expect: ModelSpec | None) -> ContainerMeta:
    raw_header = src.take(HEADER.size, "header")
    header = Header.parse(raw_header)
    body = src.take(header.meta_len - HEADER.size, "descriptor, token ids and block hashes")
    (stored,) = U64.unpack(src.take(U64.size, "meta checksum"))
    computed = checksum(raw_header, body)
    if stored != computed:
        raise ChecksumError(
            f"meta checksum {stored:#018x} != computed {computed:#018x}: the "
            "header, descriptor, token ids or block hashes are corrupt"
        )
    _skip_padding(src, "meta padding")
    meta = _parse_meta(header, body)
    _check_meta(meta, expect)
    return meta


def _parse_meta(header: Header, body: memoryview) -> ContainerMeta:
    desc = _descriptor(bytes(body[: header.desc_len]))
    token_ids = np.frombuffer(body, "<u4", header.num_tokens, header.desc_len).tolist()
    start = header.desc_len + TOKEN_BYTES * header.num_tokens
    hashes = [
        bytes(body[start + HASH_BYTES * i : start + HASH_BYTES * (i + 1)])
        for i in range(header.num_hashes)
    ]
    return ContainerMeta(header, desc, token_ids, hashes)


@lru_cache(maxsize=64)
def _descriptor(text: bytes) -> Descriptor:
    """One parse per distinct descriptor: a store's entries repeat theirs, and equal text gives
    the same (immutable) object, whose section layouts are then memoised too."""
    return Descriptor.from_json(text)


def _check_meta(meta: ContainerMeta, expect: ModelSpec | None) -> None:
    if meta.desc.layout.is_cross_layer:
        raise FormatError(
            f"descriptor axes {meta.desc.layout.axes!r} hold several layers per "
            "buffer; a container holds per-layer layouts only"
        )
    if expect is not None:
        check_compatible(expect, meta.desc.model)
    num_sections = len(owner_layers(meta.desc))
    if meta.header.num_sections != num_sections:
        raise FormatError(
            f"header counts {meta.header.num_sections} sections, the descriptor "
            f"has {num_sections} owner layers"
        )


def _read_section(src: _Source, layout: SectionLayout, index: int) -> _Section:
    raw_header = src.take(SECTION_HEADER.size, f"section {index} header")
    stored = check_section_header(raw_header, layout, index)
    what = f"section {index} (layer {layout.layer_id})"
    payload = src.take(layout.payload_len, f"{what} payload")
    computed = src.section_sum(index) if isinstance(src, _ReadAheadSource) else None
    if computed is None:
        computed = checksum(raw_header[:SECTION_HEAD_CHECKED], payload)
    if stored != computed:
        raise ChecksumError(
            f"{what}: checksum {stored:#018x} != computed {computed:#018x}; "
            f"layer {layout.layer_id} is corrupt"
        )
    _check_gaps(layout, payload, what)
    _skip_padding(src, f"{what} padding")
    return _Section(layout, payload, stored)


def _check_gaps(layout: SectionLayout, payload: memoryview, what: str) -> None:
    end = 0
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        if offset > end and any(payload[end:offset]):
            raise FormatError(f"{what}: non-zero padding before buffer {spec.key!r}")
        end = offset + spec.num_bytes


def _skip_padding(src: _Source, what: str) -> None:
    pad = padding(src.pos)
    if pad and any(src.take(pad, what)):
        raise FormatError(f"the {what} before byte {src.pos} is not all zeros")


def _tensors(layout: SectionLayout, payload: memoryview) -> dict[str, torch.Tensor]:
    """The section's buffers over the container's whole extent: views of the payload, or, for
    a sliding layer's tail, zeros before it (blocks its window no longer needs) and a copy."""
    out = _views(layout, payload)
    if layout.first:
        for spec in layout.specs:
            axis = spec.dim("B" if "B" in spec.axes else "T")
            shape = list(spec.shape)
            shape[axis] += layout.first
            whole = torch.zeros(shape, dtype=spec.dtype)
            whole.narrow(axis, layout.first, spec.shape[axis]).copy_(out[spec.key])
            out[spec.key] = whole
    return out


def _views(layout: SectionLayout, payload: memoryview) -> dict[str, torch.Tensor]:
    out = {}
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        if spec.num_bytes == 0:
            out[spec.key] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        count = spec.num_bytes // spec.dtype.itemsize
        raw = torch.frombuffer(payload, dtype=spec.dtype, count=count, offset=offset)
        out[spec.key] = raw.view(spec.shape)
    return out


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Every id in [0, vocab_size) (a reader that knows the model's vocabulary checks this
    before it trusts a cache of those tokens), else a `FormatError` naming the first one."""
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise FormatError(
            f"token id {int(ids[i])} at position {i} is outside the model's vocabulary "
            f"[0, {vocab_size}) ({bad.size} such ids)"
        )
