import pytest

from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.block_pool import BlockPool, NoFreeBlocksError


def key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 32, (i,))


def test_allocation_order_and_reuse_order_are_exact():
    pool = BlockPool(6)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b, pool.num_free) == ([0, 1, 2], [3, 4], 1)
    pool.free(a)  # tail first: 2, 1, 0 go to the back of the queue behind 5
    assert pool.allocate(4) == [5, 2, 1, 0]
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0][:5] + [1]


def test_shared_blocks_return_only_when_the_last_reference_goes():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.share(ids)
    assert pool.ref_counts[:2] == [2, 2]
    pool.free(ids)
    assert pool.num_free == 2 and pool.ref_counts[:2] == [1, 1]
    pool.free(ids)
    assert pool.num_free == 4


def test_eviction_order_is_empty_blocks_then_cached_least_recent_tail_first():
    written: list[tuple[list[int], list]] = []
    pool = BlockPool(6, write_down=lambda ids, keys: written.append((ids, keys)))
    chain = pool.allocate(3)  # [0, 1, 2]
    other = pool.allocate(2)  # [3, 4]; block 4 is a partial tail, never cached
    for i, block_id in enumerate(chain):
        assert pool.cache_block(block_id, key(i))
    assert pool.cache_block(3, key(10))
    pool.free(chain)  # cached queue: 2, 1, 0 (the chain's tail first)
    pool.free(other)  # 4 -> empty queue behind 5; 3 -> cached queue behind 0
    assert (pool.num_free, pool.num_cached, pool.num_free_cached) == (6, 4, 4)
    assert pool.allocate(6) == [5, 4, 2, 1, 0, 3]
    # handed over once, inside the allocation, in eviction order (the data is still intact)
    assert written == [([2, 1, 0, 3], [key(2), key(1), key(0), key(10)])]
    assert pool.num_cached == 0 and pool.num_evictions == 4
    assert pool.allocate(0) == [] and len(written) == 1  # nothing evicted: not called
    assert pool.cached_block(key(0).block_hash) is None


def test_a_hit_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4)
    (block_id,) = pool.allocate(1)
    pool.cache_block(block_id, key(7))
    pool.free([block_id])
    assert pool.cached_block(key(7).block_hash) == 0 and pool.num_free == 4
    assert pool.num_free_of([0, 1]) == 2
    pool.touch([0])
    assert pool.ref_counts[0] == 1 and pool.num_free == 3
    assert pool.allocate(3) == [1, 2, 3]  # never the block that was hit
    pool.touch([0])  # a second request on a held block
    assert pool.ref_counts[0] == 2 and not pool.is_writable(0)


def test_demote_puts_a_chain_first_in_the_eviction_order_tail_before_head():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for i in ids:
        pool.cache_block(i, key(i))
    pool.free([0, 1])
    pool.free([2, 3])  # cached queue: 1, 0, 3, 2
    pool.demote([2, 3])  # an idle session's chain, head first
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_a_hash_is_indexed_once_and_only_for_held_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, key(1))
    assert not pool.cache_block(b, key(1))  # the same content already cached elsewhere
    assert not pool.cache_block(a, key(2))  # a block holds one hash
    assert pool.is_writable(b) and not pool.is_writable(a)
    with pytest.raises(ValueError, match="free"):
        pool.cache_block(2, key(3))
    with pytest.raises(ValueError, match="not cached"):
        pool.touch([b])


def test_drop_cached_forgets_free_cached_blocks_only():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i in ids:
        pool.cache_block(i, key(i))
    pool.free([0, 1])
    assert pool.drop_cached() == 2
    assert pool.num_cached == 1 and pool.cached_block(key(2).block_hash) == 2
    assert pool.allocate(2) == [1, 0]  # now empty blocks, in the order they were cached


def test_misuse_is_refused():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([0])
    with pytest.raises(ValueError, match="free"):
        pool.share([1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
