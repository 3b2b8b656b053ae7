"""A hybrid model on the paged engine: sliding-window layers beside full ones, in block groups.

The tiny Llama gets per-layer windows (layers 0, 2: a 6-token window; 1, 3: full attention),
so its cache has block groups over one pool. The reference is the same model on
ContiguousAttention, which applies each layer's window to one contiguous sequence.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, ModelSpec
from kvabi.cache.kv_cache import NULL_BLOCK, KVCache
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.config import ModelConfig
from tests.engine.tiny import greedy_reference, run_all, tiny_loaded

WINDOW, BLOCK = 6, 4
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """Even layers slide, odd layers see everything (as Gemma alternates them)."""

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        dim = self.head_dim
        return tuple(
            LayerSpec(ATTN, self.num_kv_heads, dim, dim, window=WINDOW if i % 2 == 0 else 0)
            for i in range(self.num_layers)
        )


def hybrid_loaded():
    loaded = tiny_loaded(layers=4)
    fields = {f.name: getattr(loaded.config, f.name) for f in dataclasses.fields(ModelConfig)}
    return dataclasses.replace(loaded, config=HybridConfig(**fields))


PROMPTS = [list(range(70, 95)), list(range(60, 63)), [5, 9, 13] * 7]


@pytest.fixture(scope="module")
def reference():
    loaded = hybrid_loaded()
    return [greedy_reference(p, GREEDY.max_tokens, loaded=loaded) for p in PROMPTS]


def engine(**config) -> LLMEngine:
    return LLMEngine(hybrid_loaded(), EngineConfig(block_size=BLOCK, **config), "hybrid")


def test_groups_and_one_pool():
    e = engine()
    assert [(g.layer_ids, g.window, g.pool_id) for g in e.cache.groups] == [
        ((0, 2), WINDOW, 0),
        ((1, 3), 0, 0),
    ]
    assert len(e.cache.pools) == 1 and e.info.descriptor.version == (1, 2)


@pytest.mark.parametrize("backend", ["native", "batched", "reference"])
@pytest.mark.parametrize("chunk", [512, 5])
def test_greedy_equals_the_contiguous_reference(reference, backend, chunk):
    e = engine(attention_backend=backend, max_num_batched_tokens=chunk)
    outs = run_all(e, PROMPTS, GREEDY)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == reference


def test_the_sliding_group_holds_only_its_window_and_frees_the_rest():
    e = engine(enable_prefix_caching=False, max_num_batched_tokens=8)
    e.add_request(PROMPTS[0], GREEDY)
    most = 0
    while e.has_unfinished():
        e.step()
        for seq in e.scheduler.running:
            sliding, full = seq.block_tables
            held = [b for b in sliding if b != NULL_BLOCK]
            most = max(most, len(held))
            assert NULL_BLOCK not in full and len(full) == len(sliding)
            # the window before the next query, plus this step's chunk
            assert len(held) <= -(-(WINDOW - 1 + 8) // BLOCK) + 1
    assert most >= 2 and e.cache.pool.num_free == e.cache.pool.num_blocks


def test_a_prefix_hit_needs_the_full_groups_prefix_and_the_sliding_groups_window(reference):
    e = engine()
    first = run_all(e, [PROMPTS[0]], GREEDY)[0]
    again = run_all(e, [PROMPTS[0]], GREEDY)[0]  # admitted on a hit: only the last token runs
    assert tuple(first.outputs[0].token_ids) == tuple(again.outputs[0].token_ids) == reference[0]
    assert e.cache.stats.prefix.hit_tokens == len(PROMPTS[0]) - 1
    hashes = e.scheduler.block_hashes(e._new_seq("x", 0, tuple(PROMPTS[0]), GREEDY))
    hit = e.cache.match(hashes, len(PROMPTS[0]))
    assert hit.num_cached_tokens == len(PROMPTS[0]) - 1  # 24 of 25: all but the last token
    sliding, full = hit.block_tables
    first_needed = (hit.num_cached_tokens - WINDOW + 1) // BLOCK
    assert NULL_BLOCK not in full and len(full) == len(sliding) == 6
    assert sliding[:first_needed] == (NULL_BLOCK,) * first_needed
    assert NULL_BLOCK not in sliding[first_needed:]


def test_pools_of_two_geometries_share_the_tiers_each_with_its_own_codec():
    layers = (LayerSpec(ATTN, 1, 8, 8, window=4), LayerSpec(ATTN, 2, 8, 8))  # two geometries
    desc = Descriptor(ModelSpec(layers, "two-pools"), engine().info.descriptor.layout)
    cache = KVCache(desc, 8, tiers=TierConfig(host_bytes=2**20))
    first, second = cache.pool_tiers
    assert first.tiers is second.tiers and (first.owns_tiers, second.owns_tiers) == (True, False)
    assert [t.codec.desc.model.layers[0].num_kv_heads for t in cache.pool_tiers] == [1, 2]
    cache.close()
