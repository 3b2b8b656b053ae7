"""The pool tells its event sink exactly what its index gained and lost, merged as vLLM does."""

import pytest

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.cache.block_events import AllBlocksCleared, BlockEventLog, BlockRemoved, BlockStored
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.block_pool import BlockPool
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
    assert pool.drop_cached() == 1
    assert log.drain()[-1] == BlockRemoved((hashes[1],), "CPU")
    pool.free([blocks[0]])
    assert pool.drop_cached() == 1
    assert log.drain() == [AllBlocksCleared()]


def test_cleared_supersedes_what_was_pending():
    log = BlockEventLog()
    log.stored(b"a" * 32, None, (1, 2))
    log.removed(b"a" * 32)
    log.cleared()
    log.stored(b"b" * 32, None, (3, 4))
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
    log.removed(b"a" * 32)
    assert log.wait(0.0)
    log.drain()
    assert not log.wait(0.0)
