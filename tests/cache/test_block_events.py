"""The pool tells its event sink exactly what its index gained and lost, merged as vLLM does."""

import pytest

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.descriptor import ATTN, MLA, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_events import (
    UNIFORM,
    AllBlocksCleared,
    BlockEventLog,
    BlockRemoved,
    BlockStored,
    EventGroup,
    event_groups,
)
from kvabi.cache.block_groups import plan_groups
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.block_pool import BlockPool
from kvabi.cache.kv_cache import KVCache
from tests.cache.tiny import tiny_cache

DIGEST = "00112233445566778899aabbccddeeff"


def chain(n: int, bs: int = 2) -> tuple[list[int], list[bytes]]:
    ids = list(range(10, 10 + n * bs))
    return ids, hash_blocks(ids, bs, root_hash(DIGEST))


def test_a_chain_cached_in_one_step_is_one_stored_event_with_its_parent():
    log = BlockEventLog()
    prefix = tiny_cache(8, block_size=2, events=log)  # the index is the cache\'s
    pool = prefix.pool
    ids, hashes = chain(3)
    blocks = pool.allocate(3)
    prefix.cache_blocks(blocks, hashes, ids, 0, 2)  # a first step fills two blocks
    prefix.cache_blocks(blocks, hashes, ids, 2, 3)  # a later one the third: it chains on
    assert log.drain() == [BlockStored(tuple(hashes), None, tuple(ids), 2, "CPU")]
    assert log.drain() == []


def test_a_run_that_does_not_start_the_chain_names_its_parent():
    log = BlockEventLog("GPU")
    prefix = tiny_cache(8, block_size=2, events=log)  # the index is the cache\'s
    pool = prefix.pool
    ids, hashes = chain(3)
    blocks = pool.allocate(3)
    prefix.cache_blocks(blocks, hashes, ids, 0, 1)
    log.drain()
    prefix.cache_blocks(blocks, hashes, ids, 1, 3)
    assert log.drain() == [BlockStored(tuple(hashes[1:]), hashes[0], tuple(ids[2:]), 2, "GPU")]


def test_keys_carry_parents_and_a_duplicate_hash_is_not_reported():
    log = BlockEventLog()
    prefix = tiny_cache(8, block_size=2, events=log)  # the index is the cache\'s
    pool = prefix.pool
    ids, hashes = chain(2)
    keys = prefix.hasher.keys_of(hashes, ids, 1, 2)
    assert [k.parent_hash for k in keys] == [hashes[0]]
    assert keys[0] == BlockKey(hashes[1], (12, 13))  # the parent is not part of equality
    a, b = pool.allocate(2)
    assert pool.cache_block(a, keys[0])
    assert not pool.cache_block(b, keys[0])  # the pool already holds that hash
    assert log.drain() == [BlockStored((hashes[1],), hashes[0], (12, 13), 2, "CPU")]


def test_eviction_reports_removal_in_eviction_order_merged():
    log = BlockEventLog()
    prefix = tiny_cache(3, block_size=2, events=log)  # the index is the cache\'s
    pool = prefix.pool
    ids, hashes = chain(3)
    blocks = pool.allocate(3)
    prefix.cache_blocks(blocks, hashes, ids, 0, 3)
    pool.free(blocks)  # tail first: the tail is evicted first
    log.drain()
    assert pool.allocate(2) == [2, 1]
    assert log.drain() == [BlockRemoved((hashes[2], hashes[1]), "CPU")]


def test_dropping_every_cached_block_is_all_cleared_and_some_is_removed():
    log = BlockEventLog()
    prefix = tiny_cache(4, block_size=2, events=log)  # the index is the cache\'s
    pool = prefix.pool
    ids, hashes = chain(2)
    blocks = pool.allocate(2)
    prefix.cache_blocks(blocks, hashes, ids, 0, 2)
    pool.free([blocks[1]])  # block 0 is still held: it stays indexed
    assert prefix.drop_cached() == 1
    assert log.drain()[-1] == BlockRemoved((hashes[1],), "CPU")
    pool.free([blocks[0]])
    assert prefix.drop_cached() == 1
    assert log.drain() == [AllBlocksCleared()]


def test_cleared_supersedes_what_was_pending():
    log = BlockEventLog()
    log.stored(UNIFORM, b"a" * 32, None, (1, 2))
    log.removed(UNIFORM, b"a" * 32)
    log.cleared()
    log.stored(UNIFORM, b"b" * 32, None, (3, 4))
    assert log.drain() == [AllBlocksCleared(), BlockStored((b"b" * 32,), None, (3, 4), 2, "CPU")]


def test_a_pool_without_a_sink_reports_nothing_and_a_bad_medium_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, BlockKey(b"x" * 32, (1,)))
    with pytest.raises(ValueError, match="medium"):
        BlockEventLog("HBM")


def test_wait_wakes_on_an_event():
    log = BlockEventLog()
    assert not log.wait(0.0)
    log.removed(UNIFORM, b"a" * 32)
    assert log.wait(0.0)
    log.drain()
    assert not log.wait(0.0)


SLIDING, FULL = LayerSpec(ATTN, 1, 8, 8, window=4), LayerSpec(ATTN, 1, 8, 8)
SLIDING_G = EventGroup(0, "sliding_window", 4)
FULL_G = EventGroup(1, "full_attention")


def hybrid_cache(layers: tuple[LayerSpec, ...], num_blocks: int, log: BlockEventLog) -> KVCache:
    desc = preset_descriptor("vllm-flash-attn", ModelSpec(layers, "tiny-hybrid"), block_size=2)
    return KVCache(desc, num_blocks, events=log)


def test_a_hybrid_cache_names_each_group_and_merges_within_a_group_only():
    log = BlockEventLog()
    cache = hybrid_cache((SLIDING, FULL), 8, log)
    assert [(g.window, g.pool_id) for g in cache.groups] == [(4, 0), (0, 0)]
    ids, hashes = chain(2)
    sliding, full = cache.pool.allocate(2), cache.pool.allocate(2)
    cache.cache_blocks(sliding, hashes, ids, 0, 2, group_id=0)
    cache.cache_blocks(full, hashes, ids, 0, 1, group_id=1)
    cache.cache_blocks(full, hashes, ids, 1, 2, group_id=1)  # chains on: one event
    assert log.drain() == [
        BlockStored(tuple(hashes), None, tuple(ids), 2, "CPU", 0, "sliding_window", 4),
        BlockStored(tuple(hashes), None, tuple(ids), 2, "CPU", 1, "full_attention", None),
    ]
    cache.pool.free(sliding)  # the window moved on: the sliding group's blocks go first
    cache.pool.free(full)
    assert cache.pool.allocate(8)[:4] == [4, 5, 6, 7]  # the empty ones, then the cached
    assert log.drain() == [
        BlockRemoved((hashes[1], hashes[0]), "CPU", 0),
        BlockRemoved((hashes[1], hashes[0]), "CPU", 1),
    ]
    log.removed(SLIDING_G, hashes[0])
    log.removed(FULL_G, hashes[0])
    log.removed(FULL_G, hashes[1])
    assert log.drain() == [
        BlockRemoved((hashes[0],), "CPU", 0),
        BlockRemoved((hashes[0], hashes[1]), "CPU", 1),
    ]


def test_a_pool_emptied_beside_one_that_holds_blocks_is_removals_not_cleared():
    log = BlockEventLog()
    cache = hybrid_cache((SLIDING, LayerSpec(ATTN, 2, 8, 8)), 4, log)  # two geometries
    assert [g.pool_id for g in cache.groups] == [0, 1]
    ids, hashes = chain(1)
    (sliding,), (full,) = cache.pools[0].allocate(1), cache.pools[1].allocate(1)
    cache.cache_blocks([sliding], hashes, ids, 0, 1, group_id=0)
    cache.cache_blocks([full], hashes, ids, 0, 1, group_id=1)
    log.drain()
    cache.pools[0].free([sliding])  # the full group's block is still held
    assert cache.drop_cached() == 1
    assert log.drain() == [BlockRemoved((hashes[0],), "CPU", 0)]
    cache.pools[1].free([full])
    assert cache.drop_cached() == 1
    assert log.drain() == [AllBlocksCleared()]  # once, for every pool


def test_groups_are_named_by_vllms_kinds_and_a_uniform_cache_by_none():
    mla = LayerSpec(MLA, latent_dim=16, rope_dim=8)
    assert event_groups(plan_groups(ModelSpec((mla, SLIDING, FULL), "three-kinds"))) == (
        EventGroup(0, "mla_attention"),
        EventGroup(1, "sliding_window", 4),
        EventGroup(2, "full_attention"),
    )
    assert event_groups(plan_groups(ModelSpec((FULL, FULL), "uniform"))) == (UNIFORM,)
