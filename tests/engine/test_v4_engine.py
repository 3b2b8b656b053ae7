"""DeepSeek V4 (tiny random HF models, both configs of tests/models/test_deepseek_v4.py) served by
the paged engine: each layer's window of K=V rows in a sliding block group, each compressed
layer's entries (and the indexer's, on CSA) in full block groups, the compressors' partial
windows and overlap per running sequence, and the overlap at each block's end in the block's
`state` record (kvabi/engine/compressed_paged.py).

References: HF's `generate` (greedy, whole-prompt prefill) and HF's `compressed_kv`; for chunked
prefill, HF fed the same chunks (`hf_greedy_chunked`). A CSA query's top-k picks among entries
whose index scores are often exactly 0 (ReLU), and torch's top-k breaks such ties by the shape
of its input, so a prompt fed in other chunks may pick other (equally scored) entries: in HF as
in kvabi, which scores each sequence in HF's shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.descriptor import CENTRIES
from kvabi.cache.block_api import KVPayload
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.models import load_model
from kvabi.wire import container_bytes, read_container
from tests.engine.test_mla_engine import _greedy_all
from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy
from tests.models.test_deepseek_v4 import ENTRY_TOL, make_hf
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
NUM_NEW = 12
BLOCKS = {"tiny": 8, "yarn": 4}  # the smallest multiple of each config's ratios (4, 8; 2, 4)
CHUNK = 5  # chunked prefill: chunk ends fall inside windows and blocks


class Served:
    def __init__(self, variant: str, folder: Path) -> None:
        self.variant, self.block = variant, BLOCKS[variant]
        self.hf = make_hf(variant)
        self.hf.save_pretrained(folder)
        write_tokenizer(folder)
        self.loaded = load_model(folder, progress=False)
        self.prompts = [random_ids(n, seed=s) for n, s in ((23, 3), (17, 11), (30, 5))]
        self.want = []
        for p in self.prompts:
            tokens, margins = hf_greedy(self.hf, p, NUM_NEW)
            assert min(margins) > 2 * FP32_LOGIT_TOL  # no near-tie: equality is guaranteed
            self.want.append(tokens)

    def engine(self, block: int | None = None, **kwargs: Any) -> LLMEngine:
        config = EngineConfig(
            block_size=block or self.block, num_blocks=kwargs.pop("n", 96), **kwargs
        )
        return LLMEngine(self.loaded, config)


@pytest.fixture(scope="module", params=sorted(BLOCKS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(request.param, tmp_path_factory.mktemp(request.param))


def prompts_of(served: Served) -> list[list[int]]:
    return [p.tolist() for p in served.prompts]


@torch.no_grad()
def hf_greedy_chunked(hf: Any, prompt: torch.Tensor, chunk: int) -> list[int]:
    """HF greedy after a prefill in chunks of `chunk` tokens (one cache throughout)."""
    cache = transformers.DynamicCache(config=hf.config)
    tokens, ids = [], prompt
    for start in range(0, len(ids), chunk):
        positions = torch.arange(start, min(start + chunk, len(ids)))[None]
        logits = hf(ids[None, positions[0]], cache=cache, position_ids=positions).logits
    for pos in range(len(prompt), len(prompt) + NUM_NEW):
        tokens.append(int(logits[0, -1].argmax()))
        logits = hf(
            torch.tensor([tokens[-1:]]), cache=cache, position_ids=torch.tensor([[pos]])
        ).logits
    return tokens


def test_batched_greedy_equals_transformers(served: Served) -> None:
    engine = served.engine()
    layout = engine.info.descriptor.layout
    assert (layout.name, layout.block_size) == ("kvabi-compressed", served.block)
    assert _greedy_all(engine, prompts_of(served), NUM_NEW) == served.want
    assert len(engine.runner.attention.compressors) == 0  # finished sequences' states dropped


def test_chunked_prefill_equals_transformers_fed_the_same_chunks(served: Served) -> None:
    """Chunks of 5 end inside windows and blocks: the compressors carry partial windows and
    the overlap across steps, and store entries a block at a time."""
    engine = served.engine(max_num_batched_tokens=CHUNK)
    for prompt in served.prompts:
        want = hf_greedy_chunked(served.hf, prompt, CHUNK)
        assert _greedy_all(engine, [prompt.tolist()], NUM_NEW) == [want]


def test_block_size_twice_the_ratios(served: Served) -> None:
    engine = served.engine(2 * served.block)
    assert _greedy_all(engine, prompts_of(served)[:1], NUM_NEW) == served.want[:1]


@torch.no_grad()
def test_stored_entries_equal_hfs_compressed_kv(served: Served) -> None:
    """The export of a prompt's full blocks holds, per compressed layer, HF's entries (and the
    indexer's), within 1e-6 of their scale (max |entry|, about 3 here): the paged attention
    rounds apart from HF's by a few float32 ulps by the later layers (measured: 4.8e-7 in the
    first compressed layer, 1.1e-6 in the fourth, at |entry| ~ 2.9; the contiguous reference
    is within 1e-6 absolute, test_deepseek_v4.py)."""
    engine = served.engine()
    prompt = prompts_of(served)[2]
    _greedy_all(engine, [prompt], 1)
    payload = engine.cache.export(prompt, None)
    num_tokens = len(payload.token_ids)
    assert num_tokens == len(prompt) // served.block * served.block
    cache = served.hf(torch.tensor([prompt]), use_cache=True).cache
    desc = payload.cache.desc
    compared = 0
    for i, spec in enumerate(desc.model.layers):
        if spec.kind != CENTRIES:
            continue
        rows = payload.cache.tensors[str(i)].flatten(0, 1)[:, 0]  # [blocks * N / m, D (+ Di)]
        hf_layer = cache.layers[spec.compresses]
        n = num_tokens // spec.ratio
        want = hf_layer.compressed_kv["compressor"][0, :n]
        got = rows[:n, : spec.latent_dim]
        torch.testing.assert_close(got, want, atol=ENTRY_TOL * want.abs().max(), rtol=0)
        if spec.indexer_dim:
            want = hf_layer.compressed_kv["indexer"][0, :n]
            got = rows[:n, spec.latent_dim :]
            torch.testing.assert_close(got, want, atol=ENTRY_TOL * want.abs().max(), rtol=0)
        compared += 1
    assert compared == sum(1 for x in served.loaded.config.layer_types if x != "sliding_attention")


def test_prefix_hit_restores_the_overlap_from_the_block(served: Served) -> None:
    """A second request sharing the first's prompt hits its full blocks (a multiple of the
    block, hence of every ratio) and goes on from the state record of the last one."""
    engine = served.engine()
    prompt, want = prompts_of(served)[2], served.want[2]
    assert _greedy_all(engine, [prompt], NUM_NEW) == [want]
    assert _greedy_all(engine, [prompt], NUM_NEW) == [want]
    hit = engine.cache_stats()["prefix_hit_tokens"]
    assert hit == (len(prompt) - 1) // served.block * served.block > 0
    if not any(x.overlap for x in engine.info.descriptor.model.layers):
        return
    for storage in engine.cache.storages:  # the state records matter: garbage changes tokens
        for states in storage.states:
            if states is not None:
                states.normal_()
    assert _greedy_all(engine, [prompt], NUM_NEW) != [want]


def test_preemption_resumes_from_the_blocks(served: Served) -> None:
    """A pool too small for the three sequences at once: the newest is preempted, frees its
    blocks and its compressors' states, and starts again from what the prefix cache holds."""
    engine = served.engine(n=12, max_num_seqs=3)
    assert _greedy_all(engine, prompts_of(served), NUM_NEW) == served.want
    assert engine.scheduler.num_preemptions > 0


def test_host_tier_round_trip_carries_entries_and_state(served: Served) -> None:
    engine = served.engine(n=16, tiers=TierConfig(host_bytes=2**24))
    prompt, want = prompts_of(served)[2], served.want[2]
    assert _greedy_all(engine, [prompt], NUM_NEW) == [want]
    for seed in range(3):  # other prompts take the pool: the first one's blocks go down
        _greedy_all(engine, [random_ids(40, seed=100 + seed).tolist()], 2)
    engine.cache.flush()
    keys = engine.cache.hasher.keys(prompt, None)
    assert engine.cache.num_pooled([k.block_hash for k in keys]) < len(keys)
    assert _greedy_all(engine, [prompt], NUM_NEW) == [want]  # loaded back from the host tier
    assert (
        engine.cache_stats()["tier_host_hit_tokens"]
        >= len(prompt) // served.block * served.block - served.block
    )


def test_a_prompt_held_whole_hits_whole_blocks_only(served: Served) -> None:
    """A prompt of whole blocks, all cached: the hit stops at the last block boundary before
    it (not one token short of the prompt, as for other models): the compressors go on from a
    block's end alone."""
    engine = served.engine()
    prompt = prompts_of(served)[2][: 3 * served.block]
    want = _greedy_all(engine, [prompt], NUM_NEW)
    before = engine.cache_stats()["prefix_hit_tokens"]
    assert _greedy_all(engine, [prompt], NUM_NEW) == want
    assert engine.cache_stats()["prefix_hit_tokens"] - before == 2 * served.block


def test_container_carries_a_prompt_to_another_engine(served: Served) -> None:
    """Export, a container's bytes, read back and imported by a fresh engine: its greedy
    tokens are the colocated ones, over the imported blocks."""
    source, prompt = served.engine(), prompts_of(served)[0]
    _greedy_all(source, [prompt], 1)
    payload = source.cache.export(prompt, None)
    data = container_bytes(payload.cache, payload.token_ids, payload.block_hashes)
    read = read_container(data, expect=source.info.descriptor.model)
    target = served.engine()
    imported = KVPayload(0, read.token_ids, read.block_hashes, read.cache)
    placed = target.cache.import_blocks(prompt, None, imported)
    assert placed.num_cached_tokens == len(prompt) // served.block * served.block
    assert _greedy_all(target, [prompt], NUM_NEW) == served.want[:1]
    assert target.cache_stats()["prefix_hit_tokens"] == placed.num_cached_tokens


def test_the_prefix_bench_replay_hits_as_the_engine(served: Served) -> None:
    """`kvabi bench prefix` replays traces through the scheduler and pool without a model
    (prefix_workload.replay_hit_rate); on a V4 cache its hit rate is the engine's, whole
    blocks only, below the token-granular ceiling."""
    from kvabi.bench.prefix_workload import ceiling_hit_tokens, replay_hit_rate

    system = random_ids(2 * served.block + 3, seed=40).tolist()
    docs = [random_ids(served.block + 5, seed=50 + i).tolist() for i in range(3)]
    trace = [system + docs[i % 3] + docs[(i + 1) % 3] for i in range(6)]
    engine = served.engine(n=200)
    for prompt in trace:
        _greedy_all(engine, [prompt], 2)
    stats = engine.cache_stats()
    layers = served.loaded.config.kv_layers()
    replayed = replay_hit_rate(trace, 200, served.block, 2, layers)
    assert replayed == stats["prefix_hit_tokens"] / stats["prefix_query_tokens"]
    whole, queried = ceiling_hit_tokens(trace, served.block, whole_blocks=True)
    tokens, _ = ceiling_hit_tokens(trace, 1)  # a cache that could stop at any token
    assert replayed == whole / queried < tokens / queried


def test_refusals(served: Served) -> None:
    with pytest.raises(Exception, match="multiple of"):
        served.engine(served.block + 1)
    with pytest.raises(ValueError, match="speculative"):
        served.engine(speculative="ngram:k=2")
