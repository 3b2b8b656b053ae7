"""The container's byte layout: fixed-size records, alignment, and where each buffer goes.

Normative description: docs/ABI.md, section 5. Everything is little-endian; the header, meta and
every section start at a multiple of ALIGN bytes from the start of the container.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from kvabi.abi.buffers import BufferSpec, layer_buffer_specs, owner_layers
from kvabi.abi.descriptor import ATTN, Descriptor
from kvabi.abi.kv_groups import window_start
from kvabi.wire.errors import (
    BadMagicError,
    ChecksumError,
    FormatError,
    SectionPlaneError,
    VersionError,
)

MAGIC = b"KVABI\x00\r\n"
SECTION_MAGIC = b"KVSC"
END_MAGIC = b"KVEN"
MAJOR, MINOR = 1, 1
# 1.1: a sliding-window layer's section holds only the tail of the sequence its window still
# needs (docs/ABI.md 5.4). Set exactly when the descriptor has a windowed layer; a reader
# refuses any other bit, so a 1.0 reader refuses such a container instead of misreading it.
FLAG_WINDOW_TAILS = 1
KNOWN_FLAGS = FLAG_WINDOW_TAILS
ALIGN = 64
HASH_BYTES = 32
TOKEN_BYTES = 4
CHECKSUM_BYTES = 8
MAX_DESC_LEN = 1 << 24  # a descriptor is a few KiB; this bounds what a reader allocates for it

HEADER = struct.Struct(
    "<8sHHIIIII"
)  # magic, major, minor, flags, desc_len, tokens, hashes, sections
SECTION_HEADER = struct.Struct("<4sIQQQ")  # magic, layer_id, payload_len, checksum, reserved
SECTION_HEAD_CHECKED = 16  # the section header bytes its checksum covers (magic..payload_len)
END = struct.Struct("<4sIQ16s")  # magic, num_sections, checksum of section checksums, zeros
U64 = struct.Struct("<Q")


def padding(offset: int) -> int:
    """Zero bytes that bring `offset` up to the next multiple of ALIGN."""
    return -offset % ALIGN


def checksum_state() -> xxhash.xxh3_64:
    """A running `checksum`: `update` it with the parts in order, then `intdigest()`."""
    return xxhash.xxh3_64()


def checksum(*parts: bytes | memoryview) -> int:
    """xxh3_64 (seed 0) over the concatenation of `parts`, without concatenating them."""
    h = checksum_state()
    for part in parts:
        h.update(part)
    return h.intdigest()


@dataclass(frozen=True)
class Header:
    """The container's first 32 bytes."""

    desc_len: int
    num_tokens: int
    num_hashes: int
    num_sections: int
    major: int = MAJOR
    minor: int = MINOR
    flags: int = 0

    @classmethod
    def for_desc(
        cls, desc: Descriptor, desc_len: int, num_tokens: int, num_hashes: int, num_sections: int
    ) -> Header:
        """A writer's header: 1.1 with the window-tails flag when a layer slides, else 1.0
        (so a uniform model's container is byte for byte what a 1.0 writer makes)."""
        flags = flags_for(desc)
        return cls(desc_len, num_tokens, num_hashes, num_sections, MAJOR, 1 if flags else 0, flags)

    @property
    def meta_len(self) -> int:
        """Bytes from the container start to the meta checksum: header, descriptor, ids, hashes."""
        return (
            HEADER.size
            + self.desc_len
            + TOKEN_BYTES * self.num_tokens
            + HASH_BYTES * self.num_hashes
        )

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            self.major,
            self.minor,
            self.flags,
            self.desc_len,
            self.num_tokens,
            self.num_hashes,
            self.num_sections,
        )

    @classmethod
    def parse(cls, data: bytes | memoryview) -> Header:
        """Unpack and check magic, major version, flags and the descriptor length, in that order."""
        magic, major, minor, flags, desc_len, tokens, hashes, sections = HEADER.unpack(data)
        if magic != MAGIC:
            raise BadMagicError(f"not a kvabi container: magic {magic!r}, expected {MAGIC!r}")
        if major != MAJOR:
            raise VersionError(
                f"container major version {major}.{minor} is not supported "
                f"(this reader is {MAJOR}.{MINOR})"
            )
        if flags & ~KNOWN_FLAGS:
            raise VersionError(f"container flags {flags:#x} set bits this reader does not know")
        if desc_len > MAX_DESC_LEN:
            raise FormatError(f"descriptor length {desc_len} exceeds the limit {MAX_DESC_LEN}")
        return cls(desc_len, tokens, hashes, sections, major, minor, flags)


def extent_for(desc: Descriptor, num_tokens: int) -> int:
    """Blocks (paged layout) or tokens (unpaged) a container of `num_tokens` tokens carries."""
    if desc.layout.is_paged:
        return -(-num_tokens // desc.layout.block_size)
    return num_tokens


def flags_for(desc: Descriptor) -> int:
    """The flags a writer sets for a container of `desc`."""
    slides = any(x.kind == ATTN and x.window for x in desc.model.layers)
    return FLAG_WINDOW_TAILS if slides else 0


def tail_start(desc: Descriptor, layer_id: int, num_tokens: int) -> int:
    """Where a layer's section starts in a container of `num_tokens` tokens with the
    window-tails flag: for a sliding layer of window W, the block (paged) or token (unpaged)
    holding token max(num_tokens - W + 1, 0), the first key the next query (at position
    num_tokens) attends to; 0 for every other layer."""
    first_token = window_start(desc.model.layers[layer_id].window, num_tokens)
    return first_token // desc.layout.block_size if desc.layout.is_paged else first_token


@dataclass(frozen=True)
class SectionLayout:
    """One layer's payload: its buffers in spec order and each one's offset in the payload.
    The buffers hold blocks/slots `first .. first + extent - 1` of the container's."""

    layer_id: int
    specs: tuple[BufferSpec, ...]
    offsets: tuple[int, ...]
    payload_len: int
    first: int = 0
    window: int = 0  # the layer's window when its section is a tail (for error messages)

    def head(self) -> bytes:
        """The first 16 bytes of the section header, which the section checksum covers."""
        return SECTION_HEADER.pack(SECTION_MAGIC, self.layer_id, self.payload_len, 0, 0)[
            :SECTION_HEAD_CHECKED
        ]

    def header(self, section_checksum: int) -> bytes:
        return SECTION_HEADER.pack(
            SECTION_MAGIC, self.layer_id, self.payload_len, section_checksum, 0
        )


@lru_cache(maxsize=4096)  # pure, and asked for once per section of every container read
def section_layout(desc: Descriptor, layer_id: int, extent: int, first: int = 0) -> SectionLayout:
    """Buffers of `layer_id` (blocks/slots `first .. extent - 1`) each at the next multiple
    of ALIGN; payload_len ends at the last."""
    specs = tuple(layer_buffer_specs(desc, layer_id, extent - first))
    offsets, end = [], 0
    for spec in specs:
        start = end + padding(end)
        offsets.append(start)
        end = start + spec.num_bytes
    window = desc.model.layers[layer_id].window if first else 0
    return SectionLayout(layer_id, specs, tuple(offsets), end, first, window)


@lru_cache(maxsize=256)  # hashing a descriptor costs: once per container, not per section
def section_layouts(
    desc: Descriptor, num_tokens: int, flags: int | None = None
) -> tuple[SectionLayout, ...]:
    """The sections of a container, in order: one per owner layer, ascending. `flags`: the
    header's (None: what a writer sets, `flags_for`); with the window-tails flag a sliding
    layer's section is its tail (`tail_start`)."""
    extent = extent_for(desc, num_tokens)
    tails = (flags_for(desc) if flags is None else flags) & FLAG_WINDOW_TAILS
    return tuple(
        section_layout(desc, i, extent, tail_start(desc, i, num_tokens) if tails else 0)
        for i in owner_layers(desc)
    )


@lru_cache(maxsize=64)
def desc_json(desc: Descriptor) -> bytes:
    """The descriptor as the container stores it (UTF-8 JSON), made once per descriptor."""
    return desc.to_json().encode()


def container_size(desc: Descriptor, num_tokens: int, num_hashes: int) -> int:
    """Total bytes of a container; a writer's output is exactly this long."""
    meta_end = HEADER.size + len(desc_json(desc)) + TOKEN_BYTES * num_tokens
    meta_end += HASH_BYTES * num_hashes + CHECKSUM_BYTES
    size = meta_end + padding(meta_end)
    for layout in section_layouts(desc, num_tokens):
        size += SECTION_HEADER.size + layout.payload_len
        size += padding(size)
    return size + END.size


def check_section_header(data: bytes | memoryview, expected: SectionLayout, index: int) -> int:
    """Check a section header against the descriptor's layout; return the stored checksum."""
    magic, layer_id, payload_len, stored, reserved = SECTION_HEADER.unpack(data)
    where = f"section {index}"
    if magic != SECTION_MAGIC:
        raise BadMagicError(f"{where}: marker {magic!r}, expected {SECTION_MAGIC!r}")
    if layer_id != expected.layer_id:
        raise FormatError(
            f"{where} holds layer {layer_id}, expected layer {expected.layer_id} "
            "(one section per owner layer, ascending)"
        )
    if payload_len != expected.payload_len:
        _check_planes_present(expected, payload_len, where)
        tail = (
            f" (a {expected.window}-token window: blocks/slots {expected.first} on only)"
            if expected.window
            else ""
        )
        raise FormatError(
            f"{where} (layer {layer_id}): payload_len {payload_len}, the "
            f"descriptor says {expected.payload_len}{tail}"
        )
    if reserved:
        raise FormatError(f"{where} (layer {layer_id}): reserved field is {reserved:#x}, not 0")
    return stored


def _check_planes_present(expected: SectionLayout, payload_len: int, where: str) -> None:
    """A payload that ends where a sidecar buffer would start lacks that plane: say so."""
    end = 0  # the end of the buffers before spec j
    for spec, offset in zip(expected.specs, expected.offsets, strict=True):
        if spec.is_sidecar and payload_len == end:
            raise SectionPlaneError(
                expected.layer_id,
                spec.planes[0],
                f"{where}: payload_len {payload_len} ends before buffer {spec.key!r} "
                f"(the descriptor says {expected.payload_len})",
            )
        end = offset + spec.num_bytes


def end_record(section_checksums: list[int]) -> bytes:
    """The 32-byte end: marker, section count, xxh3_64 over the section checksums, zeros."""
    summary = checksum(b"".join(U64.pack(c) for c in section_checksums))
    return END.pack(END_MAGIC, len(section_checksums), summary, bytes(16))


def check_end(data: bytes | memoryview, section_checksums: list[int]) -> None:
    """Refuse an end record whose marker, count, summary checksum or zero field is wrong."""
    magic, num_sections, summary, zeros = END.unpack(data)
    expected = END.unpack(end_record(section_checksums))
    if magic != END_MAGIC:
        raise BadMagicError(f"end marker {magic!r}, expected {END_MAGIC!r}")
    if num_sections != expected[1]:
        raise FormatError(
            f"end record counts {num_sections} sections, the container has {expected[1]}"
        )
    if summary != expected[2]:
        raise ChecksumError(
            f"end record: checksum of section checksums {summary:#018x}, "
            f"computed {expected[2]:#018x}"
        )
    if any(zeros):
        raise FormatError("end record: the last 16 bytes must be zero")
