"""`BlockCodec`: one cached block <-> its tier entry, an ABI container of that block alone.

An entry is a container (docs/ABI.md, section 5) whose token ids are the block's `block_size`
tokens, whose block hashes are `[the block's chained hash]` and whose one block of K/V is in the
writer's own layout. Decoding verifies every checksum, that the entry is of this model (compat
digest), and that it is the block asked for (hash and tokens), before a byte is used; an entry
in another layout of the same model decodes too and is converted when it is placed. Runs of
entries are written and verified in bulk (kvabi/wire/entries.py): the same bytes, the same
checks, a fixed cost per run instead of per buffer of every entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_hasher import BlockKey
from kvabi.wire import FormatError, container_bytes, read_container
from kvabi.wire.entries import (
    entry_rows,
    entry_shape,
    read_entries,
    seal_entries,
    write_entries,
)


class BlockCodec:
    def __init__(self, desc: Descriptor) -> None:
        self.desc = desc

    def encode(self, blocks: CacheBuffers, index: int, key: BlockKey) -> bytes:
        """The entry of block `index` of `blocks` (a snapshot in this codec's layout)."""
        one = narrow_blocks(blocks, index, 1)
        return container_bytes(one, key.token_ids, [key.block_hash])

    def encode_many(
        self, blocks: CacheBuffers, keys: Sequence[BlockKey]
    ) -> list[bytes | memoryview]:
        """The entries of blocks 0 .. len(keys)-1 of `blocks`, written in bulk where their
        layout allows (the same bytes as `encode`'s; views of one array: `seal_entries`)."""
        shape = entry_shape(blocks.desc) if len(keys) > 1 else None
        if shape is None:
            return [self.encode(blocks, i, key) for i, key in enumerate(keys)]
        return write_entries(
            shape, blocks, [k.token_ids for k in keys], [k.block_hash for k in keys]
        )

    def encode_from(
        self, cache: CacheBuffers, block_ids: Sequence[int], keys: Sequence[BlockKey]
    ) -> tuple[list[bytes | memoryview], int]:
        """The entries of `keys`' blocks, read out of `cache` (any layout and block size of
        the model) through its `block_ids`, converted straight into the entries where their
        layout allows; and the K/V bytes they hold."""
        n = len(keys) * self.desc.layout.block_size
        shape = entry_shape(self.desc) if len(keys) > 1 else None
        if shape is None:
            blocks = convert(cache, self.desc, num_tokens=n, src_block_ids=block_ids)
            return self.encode_many(blocks, keys), blocks.num_bytes
        rows, blocks = entry_rows(shape, len(keys))
        convert(cache, self.desc, num_tokens=n, src_block_ids=block_ids, out=blocks)
        ids, hashes = [k.token_ids for k in keys], [k.block_hash for k in keys]
        return seal_entries(shape, rows, ids, hashes), blocks.num_bytes

    def decode_many(
        self, entries: Sequence[bytes | None], keys: Sequence[BlockKey]
    ) -> tuple[int, CacheBuffers | None]:
        """How many leading entries the bulk reader verified as exactly `keys`' blocks in
        this codec's layout, and their blocks (B over the entries). It stops at the first it
        cannot vouch for: `decode` that one, to refuse it with the reason or take it."""
        shape = entry_shape(self.desc)
        if shape is None:
            return 0, None
        ids, hashes = [k.token_ids for k in keys], [k.block_hash for k in keys]
        return read_entries(shape, entries, ids, hashes)

    def decode(self, entry: bytes | bytearray, key: BlockKey) -> CacheBuffers:
        """The block's K/V, in the entry's layout; raises a `KvabiError` (checksum, format,
        another model, another block) rather than return anything unverified."""
        container = read_container(entry, expect=self.desc.model)
        if container.block_hashes != [key.block_hash]:
            raise FormatError(f"entry holds hashes {container.block_hashes!r:.80}, not the block")
        if tuple(container.token_ids) != key.token_ids:
            raise FormatError("entry holds other tokens than the block its hash names")
        return container.cache


def stack_blocks(caches: Sequence[CacheBuffers]) -> CacheBuffers:
    """One cache of the given paged caches' blocks, in order (all of one paged descriptor)."""
    desc = caches[0].desc
    tensors = {
        s.key: torch.cat([c.tensors[s.key] for c in caches], dim=s.axes.index("B"))
        for s in buffer_specs(desc, 1)
    }
    return CacheBuffers(desc, tensors)


def narrow_blocks(blocks: CacheBuffers, start: int, length: int) -> CacheBuffers:
    """Views of a paged cache's blocks `start .. start + length - 1`."""
    return CacheBuffers(
        blocks.desc,
        {
            s.key: blocks.tensors[s.key].narrow(s.axes.index("B"), start, length)
            for s in buffer_specs(blocks.desc, blocks.extent)
        },
    )
