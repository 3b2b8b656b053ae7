"""Tier entries in bulk: many one-block containers of one descriptor written and verified at
once, byte for byte what `container_bytes` writes and `read_container` accepts.

A tier entry is a container of one block (kvabi/cache/block_codec.py). All entries of one
descriptor have the same bytes everywhere but in its variable fields: the block's tokens and
hash, the meta checksum, each section's checksum and buffers, and the end record's summary
checksum. `EntryShape` knows where those are; the rest is a template taken from the writer
itself. Writing N entries is then one copy of the template, one strided copy per buffer for
all N blocks, and the checksums; verifying them one comparison of every fixed byte against the
template (headers, descriptor, section markers, zero padding and reserved fields), the
checksums, and the block's identity, per entry; their buffers come back as strided views of
one `[N, entry]` array, one per buffer for all N blocks, the B axis running over the entries.

An entry this path cannot vouch for is not refused here: the reader stops before it, and the
caller reads it with `read_container`, which names exactly what is wrong with it (or accepts
it, such as an entry in another layout of the same model, which the bulk path never takes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import xxhash

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.descriptor import Descriptor
from kvabi.native.cpu_kernels import EntrySpans, cpu_kernels, kernel_threads
from kvabi.wire.container_format import (
    CHECKSUM_BYTES,
    END,
    HASH_BYTES,
    HEADER,
    SECTION_HEAD_CHECKED,
    SECTION_HEADER,
    TOKEN_BYTES,
    desc_json,
    padding,
    section_layouts,
)
from kvabi.wire.container_writer import container_bytes
from kvabi.wire.row_arena import ROWS


@dataclass(frozen=True, eq=False)
class _Section:
    head_at: int  # section header; its checksum at head_at + SECTION_HEAD_CHECKED
    payload_at: int
    payload_len: int


@dataclass(frozen=True, eq=False)
class EntryShape:
    """Where the variable fields of a one-block container of `desc` are."""

    desc: Descriptor
    size: int
    tokens_at: int
    hashes_at: int
    meta_sum_at: int
    sections: tuple[_Section, ...]
    end_at: int
    buffers: dict[str, int]  # buffer key -> its offset in the entry
    template: np.ndarray  # uint8 [size]: a writer's entry (fixed fields as every entry has them)
    fixed: np.ndarray  # int64: the offsets of every fixed byte
    fixed_values: np.ndarray  # uint8: the template's bytes there
    sums: np.ndarray  # int64 [sections + 2, 8]: where the meta, section and end checksums go
    sum_spans: EntrySpans  # where the checksums lie, for the kernels

    @property
    def block_size(self) -> int:
        return self.desc.layout.block_size


@lru_cache(maxsize=64)
def entry_shape(desc: Descriptor) -> EntryShape | None:
    """The shape of `desc`'s one-block entries, or None where the bulk path does not apply
    (an unpaged, tiled or cross-layer layout)."""
    lay = desc.layout
    if not lay.is_paged or lay.is_tiled or lay.is_cross_layer:
        return None
    bs = desc.layout.block_size
    template = container_bytes(CacheBuffers.empty(desc, 1, "zeros"), [0] * bs, [bytes(32)])
    tokens_at = HEADER.size + len(desc_json(desc))
    hashes_at = tokens_at + TOKEN_BYTES * bs
    meta_sum_at = hashes_at + HASH_BYTES
    at = meta_sum_at + CHECKSUM_BYTES
    at += padding(at)
    sections, buffers = [], {}
    variable = np.zeros(len(template), dtype=bool)
    variable[tokens_at : meta_sum_at + CHECKSUM_BYTES] = True
    for layout in section_layouts(desc, bs):
        if layout.first:
            return None
        payload_at = at + SECTION_HEADER.size
        sections.append(_Section(at, payload_at, layout.payload_len))
        variable[at + SECTION_HEAD_CHECKED : at + SECTION_HEAD_CHECKED + CHECKSUM_BYTES] = True
        for spec, offset in zip(layout.specs, layout.offsets, strict=True):
            buffers[spec.key] = payload_at + offset
            variable[payload_at + offset : payload_at + offset + spec.num_bytes] = True
        at = payload_at + layout.payload_len
        at += padding(at)
    end_sum_at = at + 8  # END: magic, count, then the summary checksum
    variable[end_sum_at : end_sum_at + CHECKSUM_BYTES] = True
    if at + END.size != len(template):
        raise AssertionError(f"entry shape: {at + END.size} bytes, the writer made {len(template)}")
    checked = [meta_sum_at, *(s.head_at + SECTION_HEAD_CHECKED for s in sections), end_sum_at]
    fixed = np.flatnonzero(~variable)
    entry = np.frombuffer(template, dtype=np.uint8).copy()
    return EntryShape(
        desc=desc,
        size=len(template),
        tokens_at=tokens_at,
        hashes_at=hashes_at,
        meta_sum_at=meta_sum_at,
        sections=tuple(sections),
        end_at=at,
        buffers=buffers,
        template=entry,
        fixed=fixed,
        fixed_values=entry[fixed],
        sums=np.asarray(checked, dtype=np.int64)[:, None] + np.arange(CHECKSUM_BYTES),
        sum_spans=EntrySpans.of(
            meta_sum_at,
            np.asarray([(s.head_at, s.payload_at, s.payload_len) for s in sections]),
            SECTION_HEAD_CHECKED,
        ),
    )


def write_entries(
    shape: EntryShape, blocks: CacheBuffers, token_ids: Sequence[Sequence[int]],
    block_hashes: Sequence[bytes],
) -> list[memoryview]:  # fmt: skip
    """The entries of `blocks`' first `len(block_hashes)` blocks (of `shape.desc`), block i
    under `token_ids[i]` and `block_hashes[i]` (as `seal_entries` returns them)."""
    if blocks.desc != shape.desc:
        raise ValueError("write_entries: the blocks are not of the shape's descriptor")
    n = len(block_hashes)
    rows, views = entry_rows(shape, n)
    for spec in buffer_specs(shape.desc, 1):
        views.tensors[spec.key].copy_(blocks.tensors[spec.key].narrow(spec.dim("B"), 0, n))
    return seal_entries(shape, rows, token_ids, block_hashes)


def entry_rows(shape: EntryShape, n: int) -> tuple[np.ndarray, CacheBuffers]:
    """Room for `n` entries, and their blocks as views into it (B over the entries), for a
    copy or a conversion to write the blocks into before `seal_entries`."""
    rows = ROWS.rows(n, shape.size)
    return rows, CacheBuffers(shape.desc, _buffer_views(shape, rows))


def seal_entries(
    shape: EntryShape, rows: np.ndarray, token_ids: Sequence[Sequence[int]],
    block_hashes: Sequence[bytes],
) -> list[memoryview]:  # fmt: skip
    """The entries whose blocks were written into `rows` (`entry_rows`), block i under
    `token_ids[i]` and `block_hashes[i]`: every other field written, checksums last. Each is a
    view of its row (no copy; `bytes(entry)` keeps one without the whole array alive)."""
    n = len(block_hashes)
    if len(rows) != n or len(token_ids) != n:
        raise ValueError(f"seal_entries: {len(rows)} rows, {len(token_ids)} token runs, {n} hashes")
    if any(len(t) != shape.block_size for t in token_ids) or any(
        len(h) != HASH_BYTES for h in block_hashes
    ):
        raise ValueError(f"seal_entries: {shape.block_size} tokens and a 32-byte hash per block")
    rows[:, shape.fixed] = shape.fixed_values
    ids = np.asarray(token_ids, dtype="<u4").reshape(n, -1).view(np.uint8)
    rows[:, shape.tokens_at : shape.hashes_at] = ids
    rows[:, shape.hashes_at : shape.meta_sum_at] = np.frombuffer(
        b"".join(block_hashes), dtype=np.uint8
    ).reshape(n, HASH_BYTES)
    sums = entry_checksums(shape, rows).astype("<u8", copy=False)
    rows[:, shape.sums] = sums.view(np.uint8).reshape(n, -1, CHECKSUM_BYTES)
    return [memoryview(row) for row in rows]  # the rows' own bytes: no copy per entry


def read_entries(
    shape: EntryShape, entries: Sequence[bytes | None], token_ids: Sequence[Sequence[int]],
    block_hashes: Sequence[bytes],
) -> tuple[int, CacheBuffers | None]:  # fmt: skip
    """How many leading entries are verified entries of `shape.desc` holding exactly block i's
    tokens and hash, and their blocks (copied out, the B axis over the entries; None for
    none). Stops at the first it cannot vouch for (absent, damaged, another layout)."""
    n = 0
    for entry in entries[: len(block_hashes)]:
        if entry is None or len(entry) != shape.size:
            break
        n += 1
    rows = ROWS.rows(n, shape.size)
    for i in range(n):
        rows[i] = np.frombuffer(entries[i], dtype=np.uint8)
    return read_rows(shape, rows, token_ids, block_hashes)


def read_rows(
    shape: EntryShape, rows: np.ndarray, token_ids: Sequence[Sequence[int]],
    block_hashes: Sequence[bytes],
) -> tuple[int, CacheBuffers | None]:  # fmt: skip
    """`read_entries` of entries already in the rows of `rows` (`[n, shape.size]` bytes, read
    there by the tier): their blocks are views of `rows`."""
    n = verify_rows(shape, rows, token_ids, block_hashes)
    return (n, rows_cache(shape, rows[:n])) if n else (0, None)


@dataclass
class RowSums:
    """The checksums a tier may take while it reads entries into rows (`KVTier.read_rows`):
    where they lie, and what it took (`[n, sections + 2]`; None where it took none)."""

    spans: EntrySpans
    out: np.ndarray | None = None


def verify_rows(
    shape: EntryShape, rows: np.ndarray, token_ids: Sequence[Sequence[int]],
    block_hashes: Sequence[bytes], sums: np.ndarray | None = None,
) -> int:  # fmt: skip
    """How many leading rows of `rows` are verified entries of `shape.desc` holding exactly
    block i's tokens and hash: every fixed byte, the identity, every checksum (all rows at
    once: the checksums by the kernels where built, without the GIL; or `sums`, the rows'
    checksums as the tier took them while it read them)."""
    n = 0
    for ids, block_hash in zip(token_ids, block_hashes[: len(rows)], strict=False):
        if len(ids) != shape.block_size or len(block_hash) != HASH_BYTES:
            break
        n += 1
    if not n:
        return 0
    rows = rows[:n]
    ok = (rows[:, shape.fixed] == shape.fixed_values).all(axis=1)
    hashes = np.frombuffer(b"".join(block_hashes[:n]), dtype=np.uint8).reshape(n, HASH_BYTES)
    ok &= (rows[:, shape.hashes_at : shape.meta_sum_at] == hashes).all(axis=1)
    stored_ids = rows[:, shape.tokens_at : shape.hashes_at].view("<u4").astype(np.int64)
    ok &= (stored_ids == np.asarray(token_ids[:n], dtype=np.int64)).all(axis=1)
    stored = np.ascontiguousarray(rows[:, shape.sums]).reshape(n, -1).view("<u8")
    sums = sums[:n] if sums is not None and len(sums) >= n else entry_checksums(shape, rows)
    ok &= (stored == sums).all(axis=1)
    return n if ok.all() else int(np.argmin(ok))


def entry_checksums(shape: EntryShape, rows: np.ndarray) -> np.ndarray:
    """The meta, section and end checksums of the entries in `rows` (`[n, size]`; their
    stored checksum fields ignored): uint64 `[n, sections + 2]`."""
    kernels = cpu_kernels()
    if kernels is not None and rows.flags.c_contiguous:
        return kernels.entry_checksums(rows, shape.sum_spans, kernel_threads())
    sums = np.empty((len(rows), len(shape.sections) + 2), dtype="<u8")
    for i, raw in enumerate(rows):
        sums[i] = _checksums(shape, raw)
    return sums


def rows_cache(shape: EntryShape, rows: np.ndarray) -> CacheBuffers:
    """The blocks of the entries in `rows` (`[n, shape.size]`) as views of it, B over them."""
    return CacheBuffers(shape.desc, _buffer_views(shape, rows))


def _checksums(shape: EntryShape, raw: np.ndarray) -> np.ndarray:
    """The meta, section and end checksums of one entry's bytes (its stored fields ignored)."""
    data = memoryview(raw)
    sums = np.empty(len(shape.sections) + 2, dtype="<u8")
    sums[0] = xxhash.xxh3_64_intdigest(data[: shape.meta_sum_at])
    h = xxhash.xxh3_64()
    for i, s in enumerate(shape.sections, 1):
        h.reset()
        h.update(data[s.head_at : s.head_at + SECTION_HEAD_CHECKED])
        h.update(data[s.payload_at : s.payload_at + s.payload_len])
        sums[i] = h.intdigest()
    sums[-1] = xxhash.xxh3_64_intdigest(sums[1:-1].tobytes())  # the section checksums, <u8 each
    return sums


def _buffer_views(shape: EntryShape, out: np.ndarray) -> dict[str, torch.Tensor]:
    """Each buffer of the entries in `out` ([n, size] bytes) as a view with B = n: one strided
    view of the rows per buffer (B steps one entry; the rest as in a one-block buffer)."""
    layouts = _layouts(shape)
    if not out.flags.c_contiguous or any(
        at % spec.dtype.itemsize or shape.size % spec.dtype.itemsize for spec, at in layouts
    ):
        return _buffer_views_sliced(shape, out)
    n, flat = out.shape[0], torch.from_numpy(out).view(-1)
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = {}
    for spec, at in layouts:
        item = spec.dtype.itemsize
        if spec.dtype not in typed:
            typed[spec.dtype] = flat.view(spec.dtype)
        b, sizes, strides = spec.dim("B"), list(spec.shape), [1] * len(spec.shape)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        sizes[b], strides[b] = n, shape.size // item
        views[spec.key] = typed[spec.dtype].as_strided(sizes, strides, at // item)
    return views


@lru_cache(maxsize=64)
def _layouts(shape: EntryShape) -> tuple:
    """(spec, byte offset in an entry) per buffer of a one-block cache of `shape.desc`."""
    return tuple((spec, shape.buffers[spec.key]) for spec in buffer_specs(shape.desc, 1))


def _buffer_views_sliced(shape: EntryShape, out: np.ndarray) -> dict[str, torch.Tensor]:
    """`_buffer_views` of rows that are not one C-ordered array, or a buffer at an offset its
    element size does not divide: per buffer, the rows' columns re-viewed."""
    n, rows = out.shape[0], torch.from_numpy(out)
    views = {}
    for spec, at in _layouts(shape):
        cols = rows[:, at : at + spec.num_bytes].view(spec.dtype)  # [n, elements]
        b = spec.dim("B")
        views[spec.key] = cols.view(n, *spec.shape).squeeze(b + 1).movedim(0, b)
    return views
