"""DeepSeek V3.2 (tiny random HF model) served by the paged engine: its layers keep their
indexer keys in the pool's sidecar plane (fp8 e4m3 codes + a float32 scale per token, vLLM's
`DeepseekV32IndexerCache` bytes) beside the latents, and each query attends only to the latents
the indexer picks among them.

transformers keeps its indexer keys unquantised, so the references are:
- `index_topk` at least the context: every key is picked whatever the keys' precision, and the
  greedy tokens equal HF's `generate` exactly;
- `index_topk` below the prompt (the sparsity bites): HF with each new indexer key rounded
  through vLLM's fp8 encoding before it is cached (`_hf_with_fp8_indexer_keys`), i.e. HF scoring
  the keys the engine stores. The engine's picks then follow HF's arithmetic on equal inputs; the
  tokens are asserted equal on prompts whose logit margins exceed the float32 tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.errors import KvabiError
from kvabi.abi.indexer_record import decode_blocks, encode_blocks, encode_tokens
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.models import load_model
from kvabi.wire import container_bytes, read_container
from tests.engine import test_mla_engine
from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy, randomize
from tests.models.test_deepseek_v32 import HF_CONFIG
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
NUM_NEW, BLOCK = 10, 4
PROMPT_LENS = (19, 9, 14)
SPARSE_TOPK = 5  # below every prompt: each query past position 4 sees 5 of its keys
LAYOUTS = ("vllm-mla", "vllm-fp8-ds-mla")


def _fp8_round(keys: torch.Tensor) -> torch.Tensor:
    """Indexer keys [..., D] as vLLM stores them and reads them back (fp8, scale per token)."""
    flat = keys.reshape(-1, keys.shape[-1])
    codes, scales = encode_tokens(flat)
    return (codes.view(torch.float8_e4m3fn).float() * scales[:, None]).view_as(keys).to(keys)


@contextmanager
def _hf_with_fp8_indexer_keys() -> Iterator[None]:
    """HF's DynamicCache caching each new indexer key rounded as the engine stores it."""
    cls = transformers.cache_utils.DynamicCache
    original = cls.update_indexer
    cls.update_indexer = lambda self, k, layer_idx: original(self, _fp8_round(k), layer_idx)
    try:
        yield
    finally:
        cls.update_indexer = original


def _make(tmp_path_factory: pytest.TempPathFactory, topk: int, geometry: dict) -> Any:
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**{**HF_CONFIG, **geometry, "index_topk": topk})
    hf = randomize(transformers.DeepseekV32ForCausalLM(config))
    folder = tmp_path_factory.mktemp(f"v32-top{topk}")
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    prompts = [random_ids(n, seed=21 + i) for i, n in enumerate(PROMPT_LENS)]  # margins > 1e-3
    with _hf_with_fp8_indexer_keys():
        want = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return hf, load_model(folder, progress=False), prompts, want


# DeepSeek V3.2's cache geometry (latent 512 + rope 64 for fp8_ds_mla records, indexer keys of
# 128: 132 bytes per token); the rest stays tiny
REAL_LATENT = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 16,
    "index_head_dim": 128,
}


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _make(tmp_path_factory, SPARSE_TOPK, REAL_LATENT)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _make(tmp_path_factory, max(PROMPT_LENS) + NUM_NEW, {})


def _greedy_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return test_mla_engine._greedy_all(engine, prompts, NUM_NEW)


def _engine(loaded: Any, layout: str = "vllm-mla", **kwargs: Any) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout=layout, **kwargs))


def test_topk_over_the_context_greedy_equals_transformers(dense: Any) -> None:
    hf, loaded, prompts, _ = dense
    want = [hf_greedy(hf, p, NUM_NEW) for p in prompts]  # HF unpatched: full-precision keys
    got = _greedy_all(_engine(loaded), [p.tolist() for p in prompts])
    for tokens, (hf_tokens, margins) in zip(got, want, strict=True):
        assert min(margins) > 2 * FP32_LOGIT_TOL
        assert tokens == hf_tokens


@pytest.mark.parametrize("chunk", [512, 4])
def test_sparse_greedy_equals_transformers_on_fp8_indexer_keys(sparse: Any, chunk: int) -> None:
    _, loaded, prompts, want = sparse
    engine = _engine(loaded, max_num_batched_tokens=chunk)
    assert engine.runner.attention.keeps_indexer
    got = _greedy_all(engine, [p.tolist() for p in prompts])
    for tokens, (hf_tokens, margins) in zip(got, want, strict=True):
        assert min(margins) > 2 * FP32_LOGIT_TOL
        assert tokens == hf_tokens


def test_sparsity_bites(sparse: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same weights with every key picked decode other tokens: the selection matters."""
    hf, loaded, prompts, want = sparse
    for layer in loaded.model.layers:
        layer.self_attn.indexer.topk = 1000
    try:
        got = _greedy_all(_engine(loaded), [p.tolist() for p in prompts])
    finally:
        for layer in loaded.model.layers:
            layer.self_attn.indexer.topk = SPARSE_TOPK
    assert got != [tokens for tokens, _ in want]


@torch.no_grad()
def test_the_pools_sidecar_is_vllms_bytes_of_hfs_indexer_keys(sparse: Any) -> None:
    """Layer 0's indexer keys are HF's bit for bit (same arithmetic on the embeddings), so the
    exported sidecar must be exactly vLLM's encoding of HF's layer-0 indexer cache; later
    layers' keys are within fp8's bound of HF's."""
    hf, loaded, prompts, _ = sparse
    prompt = prompts[0]
    engine = _engine(loaded)
    _greedy_all(engine, [prompt.tolist()])
    payload = engine.cache.export(prompt.tolist(), None)
    n = len(payload.token_ids)
    with _hf_with_fp8_indexer_keys():  # unrounded copies are kept below, by a hook
        keys = _hf_indexer_keys(hf, prompt)
    dim = REAL_LATENT["index_head_dim"]
    for layer_id, want in enumerate(keys):
        got = payload.cache.tensors[f"{layer_id}.indexer"]  # [blocks, N * (D + 4)] u8
        if layer_id == 0:
            assert torch.equal(got, encode_blocks(want[:n], BLOCK))
        decoded = decode_blocks(got, dim)[:n]
        bound = want[:n].abs() * 2**-3 + want[:n].abs().amax(-1, keepdim=True) * 2**-8 + 1e-5
        assert bool(((decoded - want[:n]).abs() <= bound).all())


def _hf_indexer_keys(hf: Any, prompt: torch.Tensor) -> list[torch.Tensor]:
    """HF's indexer keys of the prompt per layer, as computed (before the cache rounds them)."""
    seen: list[torch.Tensor] = []
    cls = transformers.cache_utils.DynamicCache
    inner = cls.update_indexer
    cls.update_indexer = lambda self, k, i: (seen.append(k[0].clone()), inner(self, k, i))[1]
    try:
        hf(prompt[None], use_cache=True)
    finally:
        cls.update_indexer = inner
    return seen


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_hit_and_host_tier_continue_the_same(sparse: Any, layout: str) -> None:
    _, loaded, prompts, want = sparse
    tiers = TierConfig(host_bytes=2**26)
    engine = _engine(loaded, layout, num_blocks=24, tiers=tiers)
    prompt, (tokens, _) = prompts[0].tolist(), want[0]
    first = _greedy_all(engine, [prompt])
    if layout == "vllm-mla":
        assert first == [tokens]
    assert _greedy_all(engine, [prompt]) == first  # a prefix-cache hit, sidecar and all
    assert engine.cache_stats()["prefix_hit_tokens"] >= len(prompt) // BLOCK * BLOCK
    for seed in range(3):  # other prompts take the pool: the first one's blocks go down
        _greedy_all(engine, [random_ids(40, seed=100 + seed).tolist()])
    engine.cache.flush()
    keys = engine.cache.hasher.keys(prompt, None)
    assert engine.cache.num_pooled([k.block_hash for k in keys]) < len(keys)
    assert engine.cache.held(keys) == len(keys)
    assert _greedy_all(engine, [prompt]) == first  # loaded back from the host tier


def test_fp8_ds_mla_records_with_the_sidecar(sparse: Any) -> None:
    """656-byte latent records plus the 132-byte-style indexer sidecar: the tokens follow
    bf16-free fp8 KV, so they are compared with the records engine's own batched backend."""
    _, loaded, prompts, _ = sparse
    ids = [p.tolist() for p in prompts]
    native = _greedy_all(_engine(loaded, "vllm-fp8-ds-mla"), ids)
    batched = _greedy_all(_engine(loaded, "vllm-fp8-ds-mla", attention_backend="batched"), ids)
    assert native == batched


def test_containers_between_v3_and_v32_are_refused(sparse: Any) -> None:
    """A V3.2 export read for a V3 cache (same latents, no indexer) is refused, and a V3
    container offered to the V3.2 engine: neither becomes a cache without its indexer keys."""
    _, loaded, prompts, _ = sparse
    engine = _engine(loaded)
    prompt = prompts[0].tolist()
    _greedy_all(engine, [prompt])
    payload = engine.cache.export(prompt, None)
    v32 = engine.info.descriptor
    v3 = replace(v32, model=replace(v32.model, layers=tuple(
        replace(x, indexer_dim=0) for x in v32.model.layers
    )))  # fmt: skip
    blob = container_bytes(payload.cache, payload.token_ids)
    assert torch.equal(read_container(blob, expect=v32.model).cache.tensors["0.indexer"],
                       payload.cache.tensors["0.indexer"])  # fmt: skip
    with pytest.raises(KvabiError, match="indexer|model"):
        read_container(blob, expect=v3.model)
    v3_cache = CacheBuffers.empty(v3, payload.cache.extent, "zeros")
    v3_blob = container_bytes(v3_cache, payload.token_ids)
    with pytest.raises(KvabiError, match="indexer|model"):
        read_container(v3_blob, expect=v32.model)
    v3_payload = replace(payload, cache=v3_cache)
    fresh = _engine(loaded)
    with pytest.raises(KvabiError):
        fresh.cache.import_blocks(prompt, None, v3_payload)
    assert fresh.cache.num_pooled(list(payload.block_hashes)) == 0  # nothing half-loaded
