import pytest

from kvabi.cache.block_pool import BlockPool, NoFreeBlocksError


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
