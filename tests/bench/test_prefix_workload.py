"""The prefix bench's workloads, its infinite-cache ceiling and its model-free replay."""

from dataclasses import replace

import pytest
import torch

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.bench.prefix_workload import (
    RagShape,
    capacity_curve,
    ceiling_hit_tokens,
    chat_schedule,
    num_block_groups,
    rag_trace,
    replay_hit_rate,
    smallest_pool,
)
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel
from tests.engine.tiny import run_all, tiny_engine, tiny_loaded, tiny_tokenizer

CORPUS = list(range(1, 250)) * 4


def test_rag_requests_are_seeded_system_documents_question():
    shape = RagShape(num_requests=5, num_docs=6, doc_len=7, system_len=9, question_len=3)
    trace = rag_trace(CORPUS, shape, seed=4)
    assert trace == rag_trace(CORPUS, shape, seed=4) != rag_trace(CORPUS, shape, seed=5)
    assert all(len(p) == 9 + 3 * 7 + 3 for p in trace)
    assert len({tuple(p[:9]) for p in trace}) == 1  # one system prompt


def test_chat_turns_interleave_in_arrival_order_and_keep_each_sessions_order():
    turns = chat_schedule(num_sessions=3, num_turns=4, mean_think_s=2.0, seed=1)
    assert [t.arrival for t in turns] == sorted(t.arrival for t in turns)
    for s in range(3):
        assert [t.turn for t in turns if t.session == s] == [0, 1, 2, 3]
    assert [t.session for t in turns[:4]] != [turns[0].session] * 4  # sessions interleave


def test_the_ceiling_counts_blocks_seen_before_capped_at_all_tokens_but_one():
    a = list(range(10))  # blocks of 4: [0..3] [4..7]
    trace = [a, a, a[:4] + [99] * 6, a[:8]]
    assert ceiling_hit_tokens(trace, 4) == (0 + 8 + 4 + 7, 10 + 10 + 10 + 8)


def test_the_replay_gets_the_engines_own_hit_rate_at_the_same_capacity():
    shape = RagShape(num_requests=12, num_docs=5, doc_len=8, system_len=8, question_len=4)
    trace = rag_trace(CORPUS, shape, seed=2)
    engine = tiny_engine(block_size=4, num_blocks=20)
    for prompt in trace:
        run_all(engine, [prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    measured = engine.cache_stats()["prefix_hit_rate"]
    assert 0 < measured < ceiling_hit_tokens(trace, 4)[0] / sum(map(len, trace))
    assert replay_hit_rate(trace, 20, 4, 2) == measured
    assert replay_hit_rate(trace, 400, 4, 2) > measured  # more capacity, more hits


def test_the_capacity_curve_rises_to_the_ceiling():
    shape = RagShape(num_requests=10, num_docs=6, doc_len=8, system_len=8, question_len=4)
    trace = rag_trace(CORPUS, shape, seed=3)
    capacities, rates = capacity_curve(trace, 4, 2)
    hits, queried = ceiling_hit_tokens(trace, 4)
    assert capacities == sorted(capacities) and capacities[0] == -(-(36 + 2) // 4) + 1
    assert rates == sorted(rates) and rates[0] < rates[-1] == hits / queried


def _windowed_engine(window: int, **config) -> LLMEngine:
    """The tiny Llama with every layer sliding over `window` tokens (one sliding group)."""
    loaded = tiny_loaded()
    cfg = replace(loaded.config, sliding_window=window)
    torch.manual_seed(0)
    loaded = LoadedModel(cfg, LlamaModel(cfg).eval(), tiny_tokenizer())
    return LLMEngine(loaded, EngineConfig(**config), fingerprint="tiny")


def test_the_replay_of_sliding_layers_gets_the_engines_own_hit_rate():
    shape = RagShape(num_requests=12, num_docs=5, doc_len=8, system_len=8, question_len=4)
    trace = rag_trace(CORPUS, shape, seed=2)
    engine = _windowed_engine(8, block_size=4, num_blocks=20)
    for prompt in trace:
        run_all(engine, [prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    measured = engine.cache_stats()["prefix_hit_rate"]
    layers = engine.loaded.config.kv_layers()
    assert layers[0].window == 8 and num_block_groups(layers) == 1
    assert 0 < measured < ceiling_hit_tokens(trace, 4)[0] / sum(map(len, trace))
    assert replay_hit_rate(trace, 20, 4, 2, layers) == measured


GEMMA_LIKE = tuple(LayerSpec(ATTN, 1, 4, 4, window=0 if i % 6 == 5 else 8) for i in range(12))


def test_a_hybrid_models_replay_rises_to_the_ceiling_and_never_past_it():
    shape = RagShape(num_requests=10, num_docs=6, doc_len=8, system_len=8, question_len=4)
    trace = rag_trace(CORPUS, shape, seed=3)
    hits, queried = ceiling_hit_tokens(trace, 4)
    assert num_block_groups(GEMMA_LIKE) == 6  # 10 sliding + 2 full layers, in groups of 2
    smallest = smallest_pool(trace, 4, 2, GEMMA_LIKE)
    assert smallest == 6 * (-(-(36 + 2) // 4) + 1)
    capacities, rates = capacity_curve(trace, 4, 2, GEMMA_LIKE)
    assert capacities[0] == smallest and rates == sorted(rates)
    assert rates[0] < rates[-1] == hits / queried
    with pytest.raises(ValueError, match="cannot hold a request"):
        replay_hit_rate(trace, smallest - 1, 4, 2, GEMMA_LIKE)
