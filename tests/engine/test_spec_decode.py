"""Speculative decoding with the n-gram proposer: greedy tokens equal decoding without it
(tiny Llama, a sliding-window hybrid, DeepSeek-V3 MLA, the bundled SmolLM2), drafts rolled
back across block boundaries, and nothing unaccepted cached or published."""

from __future__ import annotations

import pytest

from kvabi.cache.block_events import BlockEventLog, BlockStored
from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.spec_decode import (
    MAX_BACKOFF,
    SpecConfig,
    draft_cost,
    greedy_accept,
    next_backoff,
)
from tests.engine.test_hybrid_groups import hybrid_loaded
from tests.engine.tiny import greedy_reference, tiny_loaded

SPEC = "ngram:k=4,min=1,max=3,batch=32"  # every test batch speculates
# Prompts the random tiny model continues with runs of one token ([7, 3] * 9: 182 x 13), so
# drafts are accepted, and ones it does not repeat, so drafts are rejected
PROMPTS = [
    [5, 9, 13] * 7,
    list(range(70, 95)),
    [40, 41, 42, 43] * 5 + [40],
    [7, 3] * 9,
    [1, 2] * 10,
]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
            check_tables(engine)
    return [got[i] for i in ids]


def check_tables(engine: LLMEngine) -> None:
    """After every step, a running sequence holds blocks for its computed tokens only (a
    rejected draft's were freed), and every held block has a reference."""
    bs = engine.cache.block_size
    for seq in engine.scheduler.running:
        for g, table in zip(engine.cache.groups, seq.block_tables, strict=True):
            assert len(table) == -(-seq.num_computed // bs), (seq.num_computed, table)
            pool = engine.cache.pools[g.pool_id]
            assert all(pool.ref_counts[b] > 0 for b in table if b >= 0)


class ScriptedProposer:
    """Drafts the reference continuation, wrong from its `right`-th token on: every step
    accepts `right` tokens and rejects the rest (a rollback each time)."""

    def __init__(self, prompts, wants, k: int = 4, right: int = 2) -> None:
        self.full = [list(p) + list(w) for p, w in zip(prompts, wants, strict=True)]
        self.k, self.right = k, right

    def propose(self, token_ids, max_model_len, k=None):
        k = min(self.k if k is None else k, max_model_len - len(token_ids))
        ids = list(token_ids)
        full = next((f for f in self.full if f[: len(ids)] == ids), ids)  # unscripted: none
        draft = full[len(ids) : len(ids) + k]
        return [t if i < self.right else (t + 1) % 256 for i, t in enumerate(draft)]


def pair(loaded, **config) -> tuple[LLMEngine, LLMEngine]:
    plain = LLMEngine(loaded, EngineConfig(**config), "t")
    spec = LLMEngine(loaded, EngineConfig(speculative=SPEC, **config), "t")
    return plain, spec


def test_spec_config_parses_vllms_knobs_and_refuses_the_rest():
    assert SpecConfig.parse("ngram") == SpecConfig("ngram", 4, 1, 3, 4)
    assert SpecConfig.parse("ngram:k=2,min=2,max=5,batch=9") == SpecConfig("ngram", 2, 2, 5, 9)
    bad_specs = ("eagle", "ngram:k=0", "ngram:k=two", "ngram:n=3", "ngram:min=4,max=2")
    for bad in (*bad_specs, "ngram:batch=0"):
        with pytest.raises(ValueError, match="speculative|ngram"):
            EngineConfig(speculative=bad)
    assert greedy_accept([1, 2, 3], [1, 2, 9, 4]) == [1, 2, 9]
    assert greedy_accept([1, 2], [1, 2, 7]) == [1, 2, 7]
    assert greedy_accept([5], [6, 0]) == [6]
    waits = [0]
    for _ in range(7):
        waits.append(next_backoff(waits[-1], 0))
    assert waits == [0, 1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF]
    assert next_backoff(8, 1) == 0
    # early exit at half depth, k = 3: a draft costs one pass, and pays from 2 accepted on
    early = SpecConfig.parse("early-exit:k=3,exit=15")
    assert draft_cost(early, 30) == 1.0 and draft_cost(SpecConfig.parse("ngram:k=4"), 30) == 0
    assert next_backoff(8, 1, 1.0) == 16 and next_backoff(8, 2, 1.0) == 0
    waits = [0]
    for _ in range(7):
        waits.append(next_backoff(waits[-1], 1, 1.0))
    assert waits == [0, 1, 2, 4, 8, 16, 20, 20]  # about 5% of the steps wasted at the cap


def test_wholly_rejected_drafts_back_off_and_a_full_batch_does_not_speculate():
    loaded = tiny_loaded()
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    _, spec = pair(loaded, block_size=4)
    spec.scheduler.proposer = ScriptedProposer(PROMPTS, want, right=0)  # every draft wrong
    assert run(spec, PROMPTS, greedy()) == want
    assert spec.spec_stats.num_steps == 5 * len(PROMPTS)  # waits 0, 1, 2, 4, 8: 5 of 24 steps
    crowded = LLMEngine(loaded, EngineConfig(block_size=4, speculative="ngram:batch=2"), "t")
    crowded.scheduler.proposer = ScriptedProposer(PROMPTS, want, right=4)
    drafted_while = []
    original = crowded.scheduler._draft

    def spy(seq, budget):
        draft = original(seq, budget)
        if draft:
            drafted_while.append(len(crowded.scheduler.running))
        return draft

    crowded.scheduler._draft = spy
    lengths = [4, 4, 4, 24, 24]  # three end early: the batch thins from 5 to 2
    ids = [crowded.add_request(p, greedy(n)) for p, n in zip(PROMPTS, lengths, strict=True)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while crowded.has_unfinished():
        for out in crowded.step():
            got[out.request_id] += out.outputs[0].token_ids
    assert [got[i] for i in ids] == [w[:n] for w, n in zip(want, lengths, strict=True)]
    assert drafted_while and max(drafted_while) <= 2  # only once the batch thinned out


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_tokens_equal_decoding_without_speculation(block_size):
    loaded = tiny_loaded()
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    plain, spec = pair(loaded, block_size=block_size)
    assert run(plain, PROMPTS, greedy()) == want
    assert run(spec, PROMPTS, greedy()) == want
    stats = spec.spec_stats
    assert stats.num_accepted_tokens >= 10  # it speculated, and drafts were accepted ...
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ... and some were rejected
    assert spec.num_computed_tokens > plain.num_computed_tokens  # verified drafts cost tokens
    pool = spec.cache.pools[0]
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)


def test_a_small_budget_mixes_drafts_with_chunked_prefills_and_decodes():
    loaded = tiny_loaded()
    prompts = PROMPTS + [list(range(100, 160)), [11, 12] * 20]
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in prompts]
    plain, spec = pair(loaded, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert run(spec, prompts, greedy()) == want
    assert spec.spec_stats.num_accepted_tokens > 0


def test_only_accepted_blocks_are_cached_and_published():
    loaded = tiny_loaded()
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    logs = BlockEventLog(), BlockEventLog()
    engines = [
        LLMEngine(
            loaded, EngineConfig(block_size=2, speculative=s), "t", EngineHooks(block_events=log)
        )
        for s, log in zip((None, SPEC), logs, strict=True)
    ]
    engines[1].scheduler.proposer = ScriptedProposer(PROMPTS, want, right=2)  # rejects 2 of 4
    for engine in engines:
        assert run(engine, PROMPTS, greedy()) == want
    stored = [
        {(h, e.token_ids[i * 2 : i * 2 + 2]) for e in log.drain() if isinstance(e, BlockStored)
         for i, h in enumerate(e.block_hashes)}
        for log in logs
    ]  # fmt: skip
    assert stored[0] == stored[1] and len(stored[0]) > 40  # the same blocks, no draft's
    cached = [set(e.cache.pools[0]._by_hash) for e in engines]
    assert cached[0] == cached[1]
    # the cached blocks hold the accepted tokens' K/V, not a rejected draft's: continuing
    # from them (prefix hits) gives the reference's tokens
    spec, longer = engines[1], [p + w for p, w in zip(PROMPTS, want, strict=True)]
    hits = spec.cache_stats()["prefix_hit_tokens"]
    more = [list(greedy_reference(p, 4, loaded=loaded)) for p in longer]
    assert run(spec, longer, greedy(4)) == more
    assert spec.cache_stats()["prefix_hit_tokens"] - hits > 100


def test_stop_tokens_and_max_tokens_cut_an_accepted_run_as_plain_decoding_does():
    loaded = tiny_loaded()
    plain, spec = pair(loaded, block_size=4)
    want = run(plain, PROMPTS, greedy())
    stops = [w[5] for w in want]  # a token each output reaches mid-run
    params = [SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[t]) for t in stops]
    for p, prompt in zip(params, PROMPTS, strict=True):
        assert run(spec, [prompt], p) == run(plain, [prompt], p)
    assert run(spec, PROMPTS, greedy(7)) == [w[:7] for w in want]


def test_sampling_with_temperature_speculates_and_seeds_reproduce():
    """Sampled sequences verify drafts too (rejection sampling: test_spec_sampling.py checks
    the distribution); a seeded request gives the same tokens on every run. Nearly greedy
    (0.05), so the tiny model repeats its runs and n-gram drafts are accepted."""
    _, spec = pair(tiny_loaded())
    params = SamplingParams(max_tokens=12, temperature=0.05, seed=3, ignore_eos=True)
    first = run(spec, PROMPTS, params)
    assert run(spec, PROMPTS, params) == first
    assert spec.spec_stats.num_draft_tokens > 0 and spec.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("right", [0, 2, 4])
@pytest.mark.parametrize("block_size", [2, 4])
def test_scripted_drafts_accept_and_roll_back_across_block_boundaries(block_size, right):
    loaded = tiny_loaded()
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    _, spec = pair(loaded, block_size=block_size)
    spec.scheduler.proposer = ScriptedProposer(PROMPTS, want, right=right)
    assert run(spec, PROMPTS, greedy()) == want
    stats = spec.spec_stats
    assert stats.num_steps > 10
    if right == 4:  # every draft right: all accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:  # each draft cut at `right` (or shorter at the output's end)
        assert stats.num_accepted_tokens <= right * stats.num_steps
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    pool = spec.cache.pools[0]
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_sliding_window_hybrid_speculates_and_matches(backend):
    loaded = hybrid_loaded()
    want = [list(greedy_reference(p, 20, loaded=loaded)) for p in PROMPTS]
    _, spec = pair(loaded, block_size=4, attention_backend=backend)
    spec.scheduler.proposer = ScriptedProposer(PROMPTS, want, k=5, right=3)
    assert run(spec, PROMPTS, greedy(20)) == want
    assert spec.spec_stats.num_accepted_tokens > 2 * spec.spec_stats.num_steps
    for pool in spec.cache.pools:
        assert not any(pool.ref_counts)


@pytest.mark.slow
def test_the_bundled_smollm2_copies_its_prompt_with_drafts_and_the_same_tokens():
    from kvabi.models.registry import load_model

    loaded = load_model(None, "f32", progress=False)
    text = (
        "Repeat the list exactly.\nList: apples, pears, plums, figs, dates, limes, kiwis.\n"
        "Repeated list: apples, pears,"
    )
    prompt = loaded.tokenizer.encode(text)
    plain, spec = pair(loaded, block_size=16)
    want = run(plain, [prompt], greedy(20))
    assert run(spec, [prompt], greedy(20)) == want
    stats = spec.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.5, stats
    assert len(want[0]) == 20
    # early exit at half depth (a model not trained for it: drafts mostly rejected)
    early = LLMEngine(loaded, EngineConfig(speculative="early-exit:k=3,exit=15,batch=32"), "t")
    assert run(early, [prompt], greedy(20)) == want
    assert early.spec_stats.num_draft_tokens >= 3 * 4  # it drafted, and backed off


@pytest.mark.parametrize("layout", ["vllm-mla", "vllm-fp8-ds-mla"])
def test_an_mla_cache_rolls_back_drafts_and_matches(layout, tmp_path):
    pytest.importorskip("transformers")
    from kvabi.models import load_model
    from tests.models import test_deepseek_v3
    from tests.models.test_registry import _write_tokenizer
    from tests.models.tiny import random_ids

    test_deepseek_v3.make_hf("plain-512").save_pretrained(tmp_path)  # fp8 records need 512 + 64
    _write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    prompts = [random_ids(n, seed=20 + n) for n in (13, 6, 9)]
    plain, spec = pair(loaded, block_size=4, kv_layout=layout)
    want = run(plain, prompts, greedy(14))
    spec.scheduler.proposer = ScriptedProposer(prompts, want, k=3, right=2)
    assert run(spec, prompts, greedy(14)) == want
    assert spec.spec_stats.num_accepted_tokens > spec.spec_stats.num_steps
