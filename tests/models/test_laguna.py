"""Laguna (tiny random HF models, saved and loaded through kvabi): logits, incremental decode and
greedy continuations equal transformers'; per-layer query heads over one KV geometry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.models import ContiguousAttention, LagunaModel, load_hf, load_model
from kvabi.models.laguna_config import read_laguna_config
from tests.models.hf_reference import (
    FP32_LOGIT_TOL,
    assert_greedy_equal,
    assert_incremental_equal,
    assert_logits_equal,
    randomize,
    save_and_load,
)
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import hf_logits, our_logits, random_ids

transformers = pytest.importorskip("transformers")
S, F = "sliding_attention", "full_attention"
COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # per-head gate, half-rotary full layers (HF's default RoPE), router softcap and scaling
    "per-head": {
        "num_hidden_layers": 4,
        "num_attention_heads_per_layer": [4, 8, 2, 8],
        "layer_types": [S, F, S, F],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "sliding_window": 5,
        "moe_router_logit_softcapping": 2.0,
        "moe_routed_scaling_factor": 1.5,
    },
    # per-element gate, q/k/v/o biases, tied embeddings, own thetas and rotated fractions
    "per-element": {
        "num_hidden_layers": 5,
        "num_attention_heads_per_layer": [6, 2, 4, 4, 6],
        "layer_types": [S, S, F, S, F],
        "mlp_layer_types": ["sparse", "dense", "sparse", "dense", "sparse"],
        "sliding_window": 4,
        "gating": "per-element",
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            S: {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0},
            F: {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25},
        },
    },
}


def make_hf(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LagunaConfig(**COMMON, **CONFIGS[variant])
    return randomize(transformers.LagunaForCausalLM(config))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = make_hf(request.param)
    return hf, save_and_load(hf, tmp_path_factory.mktemp(request.param))


def test_logits_equal_transformers(pair: Any) -> None:
    assert_logits_equal(*pair)


def test_incremental_decode_equals_transformers(pair: Any) -> None:
    assert_incremental_equal(*pair)


def test_greedy_equals_generate(pair: Any) -> None:
    assert_greedy_equal(*pair)


def test_query_heads_vary_by_layer_kv_does_not(tmp_path: Path) -> None:
    hf = make_hf("per-head")
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, progress=False).build()
    assert model.config.kv_layers() == (
        LayerSpec(ATTN, 2, 8, 8, window=5),
        LayerSpec(ATTN, 2, 8, 8, window=0),
        LayerSpec(ATTN, 2, 8, 8, window=5),
        LayerSpec(ATTN, 2, 8, 8, window=0),
    )
    attn = ContiguousAttention.for_config(model.config)
    shapes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def spy(layer_id: int, q: torch.Tensor, k: Any, v: Any) -> torch.Tensor:
        shapes.append((layer_id, tuple(q.shape), tuple(k.shape)))
        return attn(layer_id, q, k, v)

    with torch.no_grad():
        model(random_ids(3), torch.arange(3), spy)
    assert shapes == [(i, (3, h, 8), (3, 2, 8)) for i, h in enumerate([4, 8, 2, 8])]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type 'yarn'"),
        ({"gating": "per-token"}, "gating"),
        ({"num_attention_heads_per_layer": [4, 3, 4, 4]}, "num_heads_per_layer"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_bad_configs_raise(change: dict[str, Any], message: str) -> None:
    raw = transformers.LagunaConfig(**COMMON, **CONFIGS["per-head"]).to_dict()
    with pytest.raises(ValueError, match=message):
        read_laguna_config({**raw, **change})


def test_load_model_prepares_it_unchanged(tmp_path: Path) -> None:
    """`load_model` (fuse_projections + use_kernels, no-ops here) serves the same logits."""
    hf = make_hf("per-head")
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert isinstance(loaded.model, LagunaModel) and loaded.stop_token_ids == (2, 95)
    ids = random_ids(12)
    torch.testing.assert_close(
        our_logits(loaded.model, ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )
