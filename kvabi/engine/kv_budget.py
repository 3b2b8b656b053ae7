"""How many blocks each block pool gets, and the longest sequence the pools can hold.

One pool (every uniform model, and Gemma 3, whose layers share one geometry) takes the whole
budget. Several pools (layers of different geometries, e.g. Gemma 4's sliding and global
layers) split it so that each holds the same number of sequences of the longest length: a
sliding group needs at most its window plus one step's chunk of blocks, a full group all.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_groups import BlockGroup, GroupPlan


def group_blocks(g: BlockGroup, num_tokens: int, block_size: int, chunk: int) -> int:
    """Blocks group `g` holds at most for one sequence of `num_tokens` tokens, computed in
    steps of up to `chunk` tokens (a sliding group keeps its window and the step's chunk)."""
    blocks = -(-num_tokens // block_size)
    if g.window == 0:
        return blocks
    return min(blocks, -(-(g.window - 1 + chunk) // block_size) + 1)


def pool_blocks(
    desc: Descriptor,
    plan: GroupPlan,
    kv_cache_bytes: int,
    max_len: int,
    chunk: int,
) -> tuple[int, ...]:
    """Blocks per pool for a budget of `kv_cache_bytes` (at least one each)."""
    bs = desc.layout.block_size
    per_block = [
        sum(s.num_bytes for s in buffer_specs(Descriptor(spec, desc.layout), 1))
        for spec in plan.pool_specs
    ]
    if len(per_block) == 1:
        return (max(kv_cache_bytes // per_block[0], 1),)
    need = [0] * len(per_block)  # blocks of each pool one longest sequence takes
    for g in plan.groups:
        need[g.pool_id] += group_blocks(g, max_len, bs, chunk)
    seqs = kv_cache_bytes / sum(n * b for n, b in zip(need, per_block, strict=True))
    return tuple(max(int(seqs * n), 1) for n in need)


def max_seq_tokens(
    plan: GroupPlan, blocks: Sequence[int], block_size: int, chunk: int, limit: int
) -> int:
    """The most tokens (<= `limit`) one sequence's KV can take with every pool to itself."""

    def fits(num_tokens: int) -> bool:
        need = [0] * len(blocks)
        for g in plan.groups:
            need[g.pool_id] += group_blocks(g, num_tokens, block_size, chunk)
        return all(n <= b for n, b in zip(need, blocks, strict=True))

    low, high = 0, limit  # fits(low); the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
