"""Gemma 4 and Laguna (tiny random HF models) served by the paged engine: greedy tokens equal
transformers' `generate`, with prompts several windows long, chunked prefill and a batch of
several requests; shared layers read their target's K/V and store none.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.paged_attention import LayerKV
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models import load_model
from tests.models import test_gemma4, test_laguna
from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

pytest.importorskip("transformers")
NUM_NEW, BLOCK = 12, 4
MODELS = {
    "gemma4-shared-kv": (test_gemma4.make_hf, "shared-kv"),
    "gemma4-moe-softcap": (test_gemma4.make_hf, "moe-softcap"),
    "laguna-per-head": (test_laguna.make_hf, "per-head"),
    "laguna-per-element": (test_laguna.make_hf, "per-element"),
}
PROMPT_LENS = (23, 9, 17)  # each over several windows (4 to 6 tokens) and blocks


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    make, variant = MODELS[request.param]
    hf = make(variant)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    prompts = [random_ids(n, seed=10 + i) for i, n in enumerate(PROMPT_LENS)]
    want = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return load_model(folder, progress=False), prompts, want


@pytest.mark.parametrize("chunk", [512, 8])
def test_engine_greedy_equals_transformers(served: Any, chunk: int) -> None:
    loaded, prompts, want = served
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, max_num_batched_tokens=chunk))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p.tolist(), params) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
    for i, (tokens, margins) in zip(ids, want, strict=True):
        assert min(margins) > 2 * FP32_LOGIT_TOL  # no near-tie: equality is guaranteed
        assert got[i] == tokens


def test_shared_layers_read_their_targets_kv_and_store_none(served: Any) -> None:
    loaded, _, _ = served
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK))
    specs, kv = loaded.config.kv_layers(), LayerKV.of(engine.cache)
    owners = [i for i, x in enumerate(specs) if x.has_kv]
    places = {i: (kv.group_ids[i], kv.slots[i]) for i in owners}
    assert len(set(places.values())) == len(owners)  # each owner its own (group, slot)
    for i, x in enumerate(specs):
        k, v = kv.views(i)
        assert k.shape[2:] == (x.num_kv_heads, x.k_dim) if x.has_kv else True
        if not x.has_kv:  # a shared layer: its target's very tensors, and no write
            tk, tv = kv.views(x.shares)
            assert k.data_ptr() == tk.data_ptr() and v.data_ptr() == tv.data_ptr()
            assert not kv.is_owner[i] and kv.group_ids[i] == kv.group_ids[x.shares]
    slots = sum(len(s.k) for s in engine.cache.storages)
    # a pool's slots are its longest run of layers (a group past a multiple leaves slots idle)
    assert slots == sum(
        max(len(g.layer_ids) for g in engine.cache.groups if g.pool_id == p)
        for p in range(len(engine.cache.storages))
    )


def test_tiers_and_transfers_per_group_keep_greedy_equal_to_transformers(served: Any) -> None:
    """Several pools (layer geometries): a prompt's blocks evicted down the host tier come
    back per group, and an export imported into a second engine continues, both as
    transformers' `generate`."""
    from kvabi.cache.group_blocks import held_run
    from kvabi.cache.tier_config import TierConfig

    loaded, prompts, want = served
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    config = EngineConfig(block_size=BLOCK, num_blocks=40, tiers=TierConfig(host_bytes=2**24))
    engine = LLMEngine(loaded, config)
    prompt, (tokens, _) = prompts[0].tolist(), want[0]

    def greedy(e: LLMEngine, ids: list[int]) -> list[int]:
        request_id, got = e.add_request(ids, params), []
        while e.has_unfinished():
            got += [
                t for o in e.step() if o.request_id == request_id for t in o.outputs[0].token_ids
            ]
        return got

    assert greedy(engine, prompt) == tokens
    for seed in range(4):  # other prompts take the pools: the first one's blocks go down
        greedy(engine, random_ids(30, seed=100 + seed).tolist())
    engine.cache.flush()
    keys = engine.cache.hasher.keys(prompt, None)
    assert held_run(engine.cache, [k.block_hash for k in keys]) < len(keys)  # evicted
    assert engine.cache.held(keys) == len(keys)  # every group's blocks, from the tier
    assert greedy(engine, prompt) == tokens
    payload = engine.cache.export(prompt, None)
    other = LLMEngine(loaded, EngineConfig(block_size=BLOCK))
    assert other.cache.import_blocks(prompt, None, payload).num_cached_tokens == 20
    assert greedy(other, prompt) == tokens
    assert other.cache.stats.prefix.hit_tokens == 20
