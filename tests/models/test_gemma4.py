"""Gemma 4 text (tiny random HF models, saved and loaded through kvabi): logits, incremental
decode and greedy continuations equal transformers'; shared layers store no KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.descriptor import ATTN, SHARED, LayerSpec
from kvabi.models import ContiguousAttention, Gemma4Model, load_hf, load_model
from kvabi.models.gemma4_config import read_gemma4_config
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
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
}
COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # layers 4 (sliding) and 5 (full) reuse the KV of layers 3 and 2; full layers have 1 KV
    # head of dim 16 and no v_proj (K = V); per-layer embeddings; shared layers' MLP doubled
    "shared-kv": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "sliding_window": 4,
        "layer_types": [S, S, F, S, S, F],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 96,
        "use_double_wide_mlp": True,
        "rope_parameters": ROPE,
    },
    # MoE beside every MLP, final logit softcapping, untied head, HF's default RoPE (full layers
    # rotate a quarter of the pairs at theta 1e6), no PLE, head_dim 12 / 24 (sqrt not exact)
    "moe-softcap": {
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 5,
        "head_dim": 12,
        "global_head_dim": 24,
        "sliding_window": 6,
        "layer_types": [S, F, S, S, F],
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "final_logit_softcapping": 5.0,
        "tie_word_embeddings": False,
    },
}


def make_hf(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**COMMON, **CONFIGS[variant])
    return randomize(transformers.Gemma4ForCausalLM(config))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = make_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    return hf, save_and_load(hf, folder)


def test_logits_equal_transformers(pair: Any) -> None:
    assert_logits_equal(*pair)


def test_incremental_decode_equals_transformers(pair: Any) -> None:
    assert_incremental_equal(*pair)


def test_greedy_equals_generate(pair: Any) -> None:
    assert_greedy_equal(*pair)


def test_kv_layers_mark_shared_layers(tmp_path: Path) -> None:
    hf = make_hf("shared-kv")
    hf.save_pretrained(tmp_path)
    config = load_hf(tmp_path, progress=False).config
    assert config.kv_sharing_modes() == tuple(hf.config.kv_sharing_modes)
    assert config.kv_layers() == (
        LayerSpec(ATTN, 2, 8, 8, window=4),
        LayerSpec(ATTN, 2, 8, 8, window=4),
        LayerSpec(ATTN, 1, 16, 16, window=0),
        LayerSpec(ATTN, 2, 8, 8, window=4),
        LayerSpec(SHARED, shares=3, window=4),
        LayerSpec(SHARED, shares=2, window=0),
    )


def test_shared_layers_store_no_kv(pair: Any) -> None:
    _, model = pair
    attn = ContiguousAttention.for_config(model.config)
    calls: list[tuple[int, tuple[int, ...], tuple[int, ...] | None]] = []

    def spy(layer_id: int, q: torch.Tensor, k: Any, v: Any) -> torch.Tensor:
        calls.append((layer_id, tuple(q.shape), None if k is None else tuple(k.shape)))
        assert (k is None) == (v is None)
        return attn(layer_id, q, k, v)

    with torch.no_grad():
        model(random_ids(9), torch.arange(9), spy)
    stored = [None if k is None else tuple(k.shape) for k in attn.keys]
    if model.config.num_kv_shared_layers:  # shared-kv
        assert calls == [
            (0, (9, 4, 8), (9, 2, 8)),
            (1, (9, 4, 8), (9, 2, 8)),
            (2, (9, 4, 16), (9, 1, 16)),
            (3, (9, 4, 8), (9, 2, 8)),
            (4, (9, 4, 8), None),
            (5, (9, 4, 16), None),
        ]
        assert stored == [(9, 2, 8), (9, 2, 8), (9, 1, 16), (9, 2, 8), None, None]
    else:  # moe-softcap: full layers keep the sliding layers' 2 KV heads (no K = V)
        assert stored == [(9, 2, 12), (9, 2, 24), (9, 2, 12), (9, 2, 12), (9, 2, 24)]


def test_multimodal_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    """A `gemma4` folder (Gemma4ForConditionalGeneration, weights under model.language_model.,
    a vision tower beside): the text model alone, equal to HF's on text-only input."""
    text = transformers.Gemma4TextConfig(**COMMON, **CONFIGS["shared-kv"])
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64,
    )  # fmt: skip
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    hf = randomize(transformers.Gemma4ForConditionalGeneration(config))
    hf.save_pretrained(tmp_path)
    checkpoint = load_hf(tmp_path, progress=False)
    assert not any(name.startswith(("vision", "embed_vision")) for name in checkpoint.state_dict)
    ids = random_ids(24)
    torch.testing.assert_close(
        our_logits(checkpoint.build(), ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )


def test_both_config_spellings_read_alike() -> None:
    """transformers 5.24 saves `per_layer_config`; older ones `global_head_dim` and
    `num_global_key_value_heads`: both give one Gemma4Config."""
    new = transformers.Gemma4TextConfig(**COMMON, **CONFIGS["shared-kv"]).to_dict()
    old = {k: v for k, v in new.items() if k != "per_layer_config"}
    old |= {"global_head_dim": 16, "num_global_key_value_heads": 1}
    assert "per_layer_config" in new
    assert read_gemma4_config(new) == read_gemma4_config(old)
    assert read_gemma4_config(new).layer_head_dim(2) == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"per_layer_config": {"0": {"head_dim": 16}}}, "per_layer_config"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"rope_parameters": {S: {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type 'yarn'"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
    ],
)
def test_bad_configs_raise(change: dict[str, Any], message: str) -> None:
    raw = transformers.Gemma4TextConfig(**COMMON, **CONFIGS["shared-kv"]).to_dict()
    with pytest.raises(ValueError, match=message):
        read_gemma4_config({**raw, **change})


def test_load_model_prepares_it_unchanged(tmp_path: Path) -> None:
    """`load_model` (fuse_projections + use_kernels, no-ops here) serves the same logits."""
    hf = make_hf("shared-kv")
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert isinstance(loaded.model, Gemma4Model) and loaded.stop_token_ids == (1, 95)
    ids = random_ids(12)
    torch.testing.assert_close(
        our_logits(loaded.model, ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )
