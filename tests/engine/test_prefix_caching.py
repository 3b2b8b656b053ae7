"""The prefix cache in the scheduler and engine: exact reuse, copy on write, salts, sessions,
metrics, and outputs identical to running without it."""

import re

import pytest

from kvabi.cache.tier_config import TierConfig
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import BlockCopy, Scheduler, SchedulerConfig
from kvabi.engine.sequence import Sequence
from tests.cache.tiny import tiny_cache
from tests.engine.tiny import greedy_reference, run_all, tiny_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SYSTEM = list(range(20, 33))  # 13 tokens: 3 full blocks of 4 and one token more
PROMPTS = [SYSTEM + [40, 41], SYSTEM + [50], SYSTEM[:12], SYSTEM[:5], SYSTEM + [40, 41], SYSTEM[:8]]
HITS_BS4 = [0, 12, 11, 4, 12, 7]  # tokens each of PROMPTS finds, run one after another


def tokens(engine, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in run_all(engine, prompts, params)]


def one_by_one(engine, prompts, params=GREEDY):
    """Each prompt alone; returns its tokens and the cached tokens its lookup found."""
    out, hits = [], []
    for p in prompts:
        before = engine.cache.stats.prefix.hit_tokens
        out += tokens(engine, [p], params)
        hits.append(engine.cache.stats.prefix.hit_tokens - before)
    return out, hits


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_are_identical_with_the_prefix_cache_on_and_off(block_size):
    off = tiny_engine(block_size=block_size, enable_prefix_caching=False)
    want = tokens(off, PROMPTS)
    # a hit computes only the prompt's tail (GEMMs of other row counts): equal tokens rest on
    # every step's margin being clear of rounding, which greedy_reference checks (tiny.py)
    assert want == [greedy_reference(p, GREEDY.max_tokens) for p in PROMPTS]
    on = tiny_engine(block_size=block_size)
    got, hits = one_by_one(on, PROMPTS)
    assert got == want
    if block_size == 4:
        assert hits == HITS_BS4
    assert tokens(on, PROMPTS) == want  # all at once, on a warm cache
    assert off.cache_stats()["prefix_hit_tokens"] == 0


def _seq(i, prompt):
    return Sequence(i, f"r{i}", 0, list(prompt), SamplingParams(), arrival=i)


def _step(sched):
    batch = sched.schedule()
    for s in batch.seqs:  # what the engine does after a step
        s.seq.num_computed = s.start + s.num_tokens
        sched.cache_computed(s.seq)
        if s.samples:
            s.seq.output_ids.append(0)
    return batch


def test_admission_reuses_exact_blocks_and_copies_a_cached_block_before_writing_it():
    cache = tiny_cache(8)
    pool = cache.pool
    sched = Scheduler(SchedulerConfig(), cache)
    a = _seq(0, range(10))
    sched.add(a)
    _step(sched)
    assert a.block_ids == [0, 1, 2] and pool.num_cached == 2  # blocks 0, 1 are full
    sched.finish(a, "stop")  # cached queue: 1, 0; block 2 (partial) is empty again
    b = _seq(1, range(8))  # exactly blocks 0 and 1: recompute token 7 in a copy of block 1
    sched.add(b)
    batch = _step(sched)
    assert [(s.start, s.num_tokens) for s in batch.seqs] == [(7, 1)]
    assert batch.copies == (BlockCopy(1, 3),) and b.block_ids == [0, 3]
    assert pool.ref_counts[:4] == [1, 0, 0, 1] and pool.cached_block(b.block_hashes[1]) == 1
    c = _seq(2, [*range(8), 99])  # both blocks again, then its own
    sched.add(c)
    batch = _step(sched)
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in batch.seqs] == [(1, 8, 1), (2, 8, 1)]
    assert (b.block_ids, c.block_ids, batch.copies) == ([0, 3, 4], [0, 1, 5], ())
    assert pool.ref_counts[:6] == [2, 1, 0, 1, 1, 1]
    assert sched.stats.prefix.hit_tokens == 7 + 8 and sched.stats.num_cow_copies == 1


def test_forked_samples_share_the_partial_block_until_they_write_it():
    engine = tiny_engine(block_size=4)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3, ignore_eos=True)
    rid = engine.add_request(list(range(10, 31)), params)  # 21 tokens: block 5 is partial
    engine.step()  # prefill, sample, fork
    seqs = engine.requests[rid]
    assert all(s.block_ids == seqs[0].block_ids for s in seqs)
    assert engine.cache.pool.ref_counts[seqs[0].block_ids[5]] == 3
    engine.step()  # each writes token 21 into block 5: the first two copy it, the last owns it
    assert engine.cache.stats.num_cow_copies == 2
    assert (
        len({s.block_ids[5] for s in seqs}) == 3 and seqs[2].block_ids[:5] == seqs[0].block_ids[:5]
    )
    while engine.has_unfinished():
        engine.step()
    copied = [
        c.token_ids
        for c in run_all(tiny_engine(block_size=16), [list(range(10, 31))], params)[0].outputs
    ]
    assert [s.output_ids for s in seqs] == [list(t) for t in copied]  # same seeds, no sharing


def test_tenants_with_different_cache_salts_never_share_blocks():
    engine = tiny_engine(block_size=4)
    prompt = PROMPTS[0]
    salted = [SamplingParams(**{**GREEDY.__dict__, "cache_salt": s}) for s in ("a", "b")]
    first, hits_a = one_by_one(engine, [prompt], salted[0])
    second, hits_b = one_by_one(engine, [prompt, prompt], salted[1])
    plain, hits_plain = one_by_one(engine, [prompt])
    again, hits_again = one_by_one(engine, [prompt], salted[0])
    assert (hits_a, hits_b, hits_plain, hits_again) == ([0], [0, 12], [0], [12])
    assert first == second[:1] == second[1:] == plain == again


def test_cache_stats_count_queries_hits_and_tags_exactly():
    engine = tiny_engine(block_size=4)
    for prompt, tag in zip(PROMPTS[:3], ["rag", "rag", "Chat v2!"], strict=True):
        tokens(engine, [prompt], SamplingParams(**{**GREEDY.__dict__, "tag": tag}))
    stats = engine.cache_stats()
    names = [n for n in stats if not n.startswith("tag_Chat v2!_")]  # a tag stays as given
    assert all(re.fullmatch(r"[a-z0-9_]+", name) for name in names)
    assert all(isinstance(v, float) for v in stats.values())
    assert (stats["tag_rag_queries"], stats["tag_rag_query_tokens"]) == (2, 29)
    assert (stats["tag_rag_hit_tokens"], stats["tag_rag_saved_tokens"]) == (12, 12)
    assert stats["tag_rag_hit_rate"] == pytest.approx(12 / 29)
    assert (stats["tag_Chat v2!_queries"], stats["tag_Chat v2!_hit_tokens"]) == (1, 11)
    assert (stats["prefix_queries"], stats["prefix_query_tokens"]) == (3, 41)
    assert (stats["prefix_hit_tokens"], stats["prefix_cow_copies"]) == (23, 1)
    assert stats["tier_pool_hit_tokens"] == 23 and stats["tier_pool_evictions"] == 0


def test_an_idle_sessions_blocks_are_evicted_before_older_ones():
    engine = tiny_engine(block_size=4, num_blocks=16)
    chat, other = PROMPTS[0], list(range(60, 75))  # 15 tokens + 5 computed: 5 cached blocks
    tokens(engine, [other])
    tokens(engine, [chat], SamplingParams(**{**GREEDY.__dict__, "session": "s"}))
    tokens(engine, [list(range(100, 140))])  # 40 tokens + 5: 12 blocks, 4 of them evicted
    _, hits = one_by_one(engine, [other, chat])
    assert hits == [12, 0]  # plain LRU would have evicted `other`, the older


def test_a_resumed_session_loads_its_blocks_from_the_host_tier():
    engine = tiny_engine(block_size=4, tiers=TierConfig(host_bytes=1 << 20))
    session = SamplingParams(**{**GREEDY.__dict__, "session": "s"})
    (first,) = tokens(engine, [PROMPTS[0]], session)
    engine.flush_tiers()
    assert engine.cache_stats()["tier_host_blocks"] == 5  # 15 + 5 computed tokens
    assert engine.reset_prefix_cache() == 5
    turn = PROMPTS[0] + list(first) + [7, 8, 9]
    (second,) = tokens(engine, [turn], session)
    stats = engine.cache_stats()
    assert (stats["tier_host_hit_tokens"], stats["tier_pool_hit_tokens"]) == (20, 0)
    assert stats["tier_host_loads"] == 1 and stats["tier_host_load_latency_ms"] > 0
    assert second == greedy_reference(turn, GREEDY.max_tokens)
    engine.flush_tiers()  # the session is idle again: only its 2 new blocks are written
    stats = engine.cache_stats()
    assert (stats["tier_host_writes"], stats["tier_write_dropped_blocks"]) == (7, 0)
    engine.close()


def test_tiers_need_the_prefix_cache():
    with pytest.raises(ValueError, match="^tiers:"):
        tiny_engine(enable_prefix_caching=False, tiers=TierConfig(host_bytes=1))
