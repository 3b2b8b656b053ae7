"""`KVCache`: the prefix match over the pool's index, and the block API (export, import)."""

import pytest
import torch

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.cache.block_hasher import BlockHasher
from kvabi.cache.kv_cache import NO_MATCH, ImportResult, MatchResult
from tests.cache.tiny import tiny_cache

DIGEST = "0273b6b1e5590f4c68ab2e1a6b4ed70a"
TOKENS = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one


def cache_with_chain(tokens, salt=None, num_blocks=8):
    """A cache whose blocks 0, 1, ... hold the full blocks of `tokens`, all free and cached."""
    prefix = tiny_cache(num_blocks)
    root = prefix.hasher.root(salt)
    hashes = prefix.hasher.hashes(tokens, salt)
    ids = prefix.pool.allocate(len(hashes))
    prefix.cache_blocks(ids, hashes, tokens, 0, len(ids))
    prefix.pool.free(ids)
    return prefix, root


def hashes_of(prefix, root, tokens):
    out: list[bytes] = []
    prefix.hasher.extend(out, root, tokens)
    return out


def test_hashes_are_the_abi_chain_and_extend_incrementally():
    hasher = BlockHasher(DIGEST, 4)
    root = hasher.root("tenant-a")
    assert root == root_hash(DIGEST, {"cache_salt": "tenant-a"})
    assert hasher.root("tenant-a") is root  # memoised
    hashes: list[bytes] = []
    hasher.extend(hashes, root, TOKENS[:5])
    assert len(hashes) == 1
    hasher.extend(hashes, root, TOKENS)  # the sequence grew
    assert hashes == hash_blocks(TOKENS, 4, root) == hasher.hashes(TOKENS, "tenant-a")
    keys = hasher.keys(TOKENS, "tenant-a")
    assert [k.token_ids for k in keys] == [(100, 101, 102, 103), (104, 105, 106, 107)]
    assert [k.parent_hash for k in keys] == [None, hashes[0]]
    assert [k.block_hash for k in hasher.keys_of(hashes, TOKENS, 1, 2)] == hashes[1:]


def test_an_empty_salt_is_refused_not_read_as_no_salt():
    with pytest.raises(ValueError, match="cache_salt"):
        BlockHasher(DIGEST, 4).root("")


def test_match_returns_the_longest_pooled_run_with_exact_block_ids():
    prefix, root = cache_with_chain(TOKENS)
    longer = TOKENS + [7, 7, 7]
    assert prefix.match(hashes_of(prefix, root, longer), len(longer)) == MatchResult(8, ((0, 1),))
    diverged = TOKENS[:4] + [0] + TOKENS[5:]  # second block differs: the run stops there
    assert prefix.match(hashes_of(prefix, root, diverged), 10) == MatchResult(4, ((0,),))
    other = [1] + TOKENS[1:]  # the first block differs: every later hash differs too
    assert prefix.match(hashes_of(prefix, root, other), 10) == NO_MATCH


def test_a_fully_cached_prompt_leaves_its_last_token_to_compute():
    prefix, root = cache_with_chain(TOKENS)
    exact = TOKENS[:8]  # both full blocks cached: recompute token 7 in a copy of block 1
    assert prefix.match(hashes_of(prefix, root, exact), 8) == MatchResult(7, ((0, 1),))
    one = TOKENS[:4]
    assert prefix.match(hashes_of(prefix, root, one), 4) == MatchResult(3, ((0,),))


def test_a_cache_salt_changes_every_hash_so_tenants_never_share():
    prefix, root = cache_with_chain(TOKENS, salt="tenant-a")
    plain = hashes_of(prefix, prefix.hasher.root(), TOKENS)
    other = hashes_of(prefix, prefix.hasher.root("tenant-b"), TOKENS)
    same = hashes_of(prefix, prefix.hasher.root("tenant-a"), TOKENS)
    assert prefix.match(plain, 10) == NO_MATCH and prefix.match(other, 10) == NO_MATCH
    assert prefix.match(same, 10) == MatchResult(8, ((0, 1),))
    assert not set(plain) & set(same)


def test_pooled_blocks_follows_the_given_order_and_skips_evicted():
    prefix, root = cache_with_chain(TOKENS)
    hashes = hashes_of(prefix, root, TOKENS)
    assert prefix.pooled_ids(hashes) == [0, 1] and prefix.num_pooled(hashes) == 2
    prefix.pool.allocate(prefix.pool.num_free - 1)  # evicts block 1 (the tail) first
    assert prefix.pooled_ids(hashes) == [0] and prefix.num_pooled(hashes) == 1


def filled(cache, seed):
    gen = torch.Generator().manual_seed(seed)
    for t in cache.storage.buffers.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def test_export_then_import_places_the_same_kv_under_the_importers_own_blocks():
    src = filled(tiny_cache(8), seed=1)
    ids = src.pool.allocate(2)  # blocks 0, 1 hold TOKENS' two full blocks
    src.cache_blocks(ids, src.hasher.hashes(TOKENS), TOKENS, 0, 2)
    payload = src.export(TOKENS, None)
    assert (payload.start_token, payload.token_ids) == (0, tuple(TOKENS[:8]))
    assert payload.block_hashes == tuple(src.hasher.hashes(TOKENS)) and payload.cache.extent == 2
    dst = tiny_cache(8, layout="vllm-flash-attn-hnd")
    assert dst.import_blocks(TOKENS, None, payload) == ImportResult(8, 2)
    blocks = [dst.pool.cached_block(h) for h in payload.block_hashes]
    assert blocks == [0, 1] and dst.pool.num_free == 8  # cached, unreferenced
    for b in blocks:
        src_k, dst_k = src.storage.k[0][b], dst.storage.k[0][b]
        assert torch.equal(src_k, dst_k)  # a layout conversion is data movement: exact
    assert dst.import_blocks(TOKENS, None, payload) == ImportResult(8, 0)  # held: not twice
    assert dst.export(TOKENS, None, start_token=4).token_ids == tuple(TOKENS[4:8])


def test_an_import_that_would_not_extend_the_pooled_prefix_places_nothing():
    src = filled(tiny_cache(8), seed=2)
    src.cache_blocks(src.pool.allocate(2), src.hasher.hashes(TOKENS), TOKENS, 0, 2)
    tail = src.export(TOKENS, None, start_token=4)  # block 1 only: block 0 is not here
    dst = tiny_cache(8)
    assert dst.import_blocks(TOKENS, None, tail) == ImportResult(0, 0)
    assert dst.pool.num_cached == 0
    # the importer names blocks with its own hashes: under a salt, that tenant's chain only
    assert dst.import_blocks(TOKENS, "tenant-a", src.export(TOKENS, None)) == ImportResult(8, 2)
    assert dst.num_pooled(dst.hasher.hashes(TOKENS, "tenant-a")) == 2
    assert dst.num_pooled(dst.hasher.hashes(TOKENS)) == 0


def test_a_loan_pins_the_pooled_blocks_until_released():
    prefix, _ = cache_with_chain(TOKENS)  # blocks 0, 1 cached and free
    loan = prefix.lend(TOKENS, None, 4)  # from the second block on
    assert (loan.start_token, loan.token_ids, loan.block_ids) == (4, tuple(TOKENS[4:8]), (1,))
    assert loan.block_hashes == tuple(prefix.hasher.hashes(TOKENS, None)[1:])
    assert loan.buffers is prefix.storage.buffers
    assert (prefix.pool.ref_counts[1], prefix.pool.num_free) == (1, 7)
    prefix.pool.allocate(7)  # every free block: the lent one is not among them
    assert prefix.cached_in(0, loan.block_hashes[0]) == 1
    loan.release()
    assert prefix.pool.ref_counts[1] == 0 and prefix.pool.num_free == 1
    assert prefix.lend(TOKENS, "salted", 0).block_ids == ()  # nothing pooled under that salt


def test_a_reservation_is_indexed_on_commit_and_forgotten_on_cancel():
    prefix, _ = cache_with_chain(TOKENS[:4])  # block 0 holds the first block
    longer = TOKENS + [7, 7]  # 3 full blocks
    assert prefix.reserve(longer, None, 8, 1) is None  # it would not extend the pooled run
    res = prefix.reserve(longer, None, 4, 5)  # more than exist: the 2 that do
    assert (res.start_token, res.block_ids, res.pooled) == (4, (1, 2), (0,))
    assert [k.token_ids for k in res.keys] == [tuple(TOKENS[4:8]), (108, 109, 7, 7)]
    prefix.cancel(res)
    assert prefix.num_pooled(prefix.hasher.hashes(longer, None)) == 1
    assert prefix.pool.num_free == 8 and prefix.pool.ref_counts[0] == 0
    res = prefix.reserve(longer, None, 4, 2)
    assert prefix.commit(res, 1) == ImportResult(8, 1)  # only the first one was written
    assert prefix.num_pooled(prefix.hasher.hashes(longer, None)) == 2
    assert prefix.pool.num_free == 8


def test_a_reservation_takes_no_more_blocks_than_are_free():
    prefix, _ = cache_with_chain(TOKENS[:4], num_blocks=3)
    prefix.pool.allocate(1)  # 2 free, one of them the pooled prefix
    res = prefix.reserve(TOKENS + [7, 7], None, 4, 2)
    assert len(res.block_ids) == 1
