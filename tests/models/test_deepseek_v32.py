"""DeepSeek V3.2 (tiny random HF model, saved and loaded through kvabi) against transformers'
`DeepseekV32ForCausalLM`: with `index_topk` below the prompt length, so the sparsity bites, the
indexer picks HF's keys, logits, decode and greedy tokens equal HF's, and the cached indexer
keys equal HF's indexer cache (and survive a container as vLLM's 132-byte-style records)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import MLA, LayerSpec, ModelSpec
from kvabi.abi.indexer_record import decode_blocks, encode_blocks
from kvabi.abi.presets import preset_descriptor
from kvabi.models import ContiguousAttention, ContiguousSparseAttention, DeepseekV32Model
from kvabi.models.errors import CheckpointError
from kvabi.wire import container_bytes, read_container
from tests.models.hf_reference import FP32_LOGIT_TOL, randomize, save_and_load
from tests.models.tiny import hf_logits, random_ids

transformers = pytest.importorskip("transformers")
TOPK = 5
PROMPT = 14  # > TOPK: every query past position TOPK - 1 attends to only TOPK keys
LATER_KEY_TOL = 1e-5  # later layers' inputs carry the absorbed MLA's float32 rounding
HF_CONFIG: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": TOPK,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**HF_CONFIG)
    hf = randomize(transformers.DeepseekV32ForCausalLM(config))
    return hf, save_and_load(hf, tmp_path_factory.mktemp("v32"))


def _attn(model: DeepseekV32Model) -> ContiguousSparseAttention:
    return ContiguousSparseAttention(model.config.kv_layers())


@torch.no_grad()
def _hf_picks(hf: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """HF's indexer output per layer (bool [S, T], True at the picked keys) and its cache."""
    picks: list[torch.Tensor] = []

    def hook(_module: Any, _args: Any, out: torch.Tensor) -> None:
        picks.append(out[0].long())  # [S, topk] int32 indices

    handles = [layer.self_attn.indexer.register_forward_hook(hook) for layer in hf.model.layers]
    try:
        out = hf(ids[None], use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return picks, out.past_key_values if hasattr(out, "past_key_values") else out.cache


def test_the_model_and_its_kv_spec(pair: Any) -> None:
    _, model = pair
    assert isinstance(model, DeepseekV32Model)
    spec = LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=16)
    assert model.config.kv_layers() == (spec,) * 3


@torch.no_grad()
def test_the_indexer_picks_hfs_keys_and_attention_is_sparse(pair: Any) -> None:
    hf, model = pair
    ids = random_ids(PROMPT)
    hf_picks, _ = _hf_picks(hf, ids)
    ours: list[torch.Tensor] = []
    for layer in model.layers:  # record each indexer's selection (instance attribute)
        select = layer.self_attn.indexer.select
        layer.self_attn.indexer.select = lambda *a, f=select: ours.append(f(*a)) or ours[-1]
    try:
        model(ids, torch.arange(PROMPT), _attn(model))
    finally:
        for layer in model.layers:
            del layer.self_attn.indexer.select
    causal = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    for keep, picked in zip(ours, hf_picks, strict=True):
        want = torch.zeros(PROMPT, PROMPT, dtype=torch.bool).scatter_(1, picked, True) & causal
        assert torch.equal(keep, want)
        assert keep.sum(-1).tolist() == [min(t + 1, TOPK) for t in range(PROMPT)]


@torch.no_grad()
def test_logits_equal_transformers_and_differ_from_dense(pair: Any) -> None:
    hf, model = pair
    ids = random_ids(PROMPT)
    ours = model(ids, torch.arange(PROMPT), _attn(model))
    expected = hf_logits(hf, ids)
    torch.testing.assert_close(ours, expected, atol=FP32_LOGIT_TOL, rtol=0)
    for layer in model.layers:  # every key kept: dense MLA, which HF's sparse output is not
        layer.self_attn.indexer.topk = PROMPT
    try:
        dense = model(ids, torch.arange(PROMPT), _attn(model))
    finally:
        for layer in model.layers:
            layer.self_attn.indexer.topk = TOPK
    assert (dense[TOPK:] - expected[TOPK:]).abs().max() > 100 * FP32_LOGIT_TOL


@torch.no_grad()
def test_decode_and_greedy_equal_transformers(pair: Any) -> None:
    hf, model = pair
    prompt, num_new = random_ids(PROMPT, seed=3), 12
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=0,
        pad_token_id=0,
    )
    want = out[0, PROMPT:].tolist()
    attn = _attn(model)
    tokens = [int(model(prompt, torch.arange(PROMPT), attn)[-1].argmax())]
    for pos in range(PROMPT, PROMPT + num_new - 1):
        tokens.append(int(model(torch.tensor(tokens[-1:]), torch.tensor([pos]), attn)[-1].argmax()))
    assert tokens == want
    assert attn.indexer_keys[0].shape == (PROMPT + num_new - 1, 16)


@torch.no_grad()
def test_indexer_keys_equal_hfs_indexer_cache(pair: Any) -> None:
    hf, model = pair
    ids = random_ids(PROMPT)
    _, cache = _hf_picks(hf, ids)
    attn = _attn(model)
    model(ids, torch.arange(PROMPT), attn)
    for layer_id, layer in enumerate(cache.layers):
        want = layer.indexer_keys[0]  # [T, index_head_dim]
        tol = 0.0 if layer_id == 0 else LATER_KEY_TOL
        torch.testing.assert_close(attn.indexer_keys[layer_id], want, atol=tol, rtol=0)


@torch.no_grad()
def test_the_indexer_keys_travel_in_a_container(pair: Any) -> None:
    """HF's indexer keys as the sidecar of a vllm-mla container: read back, they decode to
    the keys within the e4m3 bound (|err| <= 2^-4 |x| + scale 2^-9)."""
    hf, model = pair
    ids = random_ids(PROMPT)
    _, cache = _hf_picks(hf, ids)
    spec = ModelSpec(model.config.kv_layers(), "tiny-v32")
    desc = preset_descriptor("vllm-mla", spec, block_size=4, dtype="f32")
    buffers = CacheBuffers.empty(desc, 4, "zeros")
    for layer_id, layer in enumerate(cache.layers):
        buffers.tensors[f"{layer_id}.indexer"].copy_(encode_blocks(layer.indexer_keys[0], 4))
    got = read_container(container_bytes(buffers, ids.tolist()), expect=spec).cache
    for layer_id, layer in enumerate(cache.layers):
        keys = layer.indexer_keys[0]
        decoded = decode_blocks(got.tensors[f"{layer_id}.indexer"], 16)[:PROMPT]
        bound = keys.abs() * 2**-4 + keys.abs().amax(-1, keepdim=True) / 448 * 2 * 2**-9
        assert ((decoded - keys).abs() <= bound).all()


def test_a_plain_attention_is_refused(pair: Any) -> None:
    _, model = pair
    with pytest.raises(CheckpointError, match="indexer keys"):
        model(random_ids(3), torch.arange(3), ContiguousAttention(model.config.kv_layers()))


def test_config_refusals(tmp_path: Path) -> None:
    from kvabi.models.deepseek_v3_config import read_deepseek_v32_config

    raw = transformers.DeepseekV32Config(**HF_CONFIG).to_dict()
    config = read_deepseek_v32_config(raw)
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (8, 16, TOPK)
    assert config.rope_interleave and config.first_k_dense_replace == 1
    with pytest.raises(CheckpointError, match="index_head_dim"):
        read_deepseek_v32_config({**raw, "index_head_dim": 4})
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        read_deepseek_v32_config({**raw, "mlp_layer_types": ["sparse", "dense", "sparse"]})
