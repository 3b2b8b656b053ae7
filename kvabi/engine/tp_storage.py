"""`TPStorage`: rank 0's KV storage in a tensor-parallel group.

Its tensors hold rank 0's KV heads (what its attention reads and writes, `desc`), but the
whole blocks it reads and writes for the prefix cache's tiers and the prefill/decode
transfers hold every rank's (`entry_desc`: the model's cache, tp 1/1): `read_blocks` gathers
the workers' heads of those blocks and merges them, `write_blocks` splits a whole cache by
the plan and sends each worker its heads (kvabi/parallel/tp_heads.py). So a tier entry or a
transfer made at one TP size is read at any other. Copy-on-write copies stay local: every
rank makes them from the step's broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.kv_storage import KVStorage
from kvabi.engine.tp_group import TPGroup
from kvabi.parallel.tp_heads import merge_heads, shard_descs, split_heads


class TPStorage(KVStorage):
    def __init__(self, whole: Descriptor, num_blocks: int, group: TPGroup, pool_id: int) -> None:
        """`whole`: the pool's cache over every rank's heads; `group.plan` says which rank
        holds which."""
        self.group, self.pool_id, self.plan = group, pool_id, group.plan
        self.descs = shard_descs(whole, self.plan)  # per rank
        super().__init__(self.descs[0], num_blocks)
        self.entry_desc = whole
        self._entry_bytes = CacheBuffers.empty(whole, 1).num_bytes

    @property
    def entry_block_bytes(self) -> int:
        return self._entry_bytes

    def read_blocks(self, block_ids: Sequence[int]) -> CacheBuffers:
        """A copy of these blocks over every rank's heads, in the whole cache's layout."""
        mine = super().read_blocks(block_ids)
        theirs = self.group.gather_blocks(self.pool_id, list(block_ids), self.descs)
        return merge_heads([mine, *theirs], self.plan, self.entry_desc)

    def write_blocks(
        self, cache: CacheBuffers, block_ids: Sequence[int], src_ids: Sequence[int] | None = None
    ) -> None:
        """Place a whole cache's first `len(block_ids)` blocks' worth of tokens (any layout of
        this model; with `src_ids`, its blocks `src_ids`) into `block_ids` on every rank, each
        its heads."""
        n = len(block_ids) * self.block_size
        whole = convert(cache, self.entry_desc, num_tokens=n, src_block_ids=src_ids)
        shards = split_heads(whole, self.plan, self.descs)
        super().write_blocks(shards[0], block_ids)
        self.group.scatter_blocks(self.pool_id, list(block_ids), shards)
