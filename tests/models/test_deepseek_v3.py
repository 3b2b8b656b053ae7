"""DeepSeek-V3 (tiny random HF models, saved and loaded through kvabi): logits, incremental decode,
greedy continuations and the cached MLA latents equal transformers'; YaRN tables to the bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.descriptor import MLA, LayerSpec
from kvabi.models import ContiguousAttention, DeepseekV3Model, load_hf, load_model
from kvabi.models.deepseek_v3_config import deepseek_v3_weight_name, read_deepseek_v3_config
from kvabi.models.errors import CheckpointError, UnknownArchitectureError
from kvabi.models.hf_loader import read_hf_config
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
LATER_LATENT_TOL = 1e-5  # see test_cached_latents_equal_hf_cache
COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,  # 256 / 64 = factor, as HF expects
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,  # != mscale: cos/sin and the softmax scale both move off 1
}
CONFIGS: dict[str, dict[str, Any]] = {
    # low-rank query, interleaved YaRN RoPE, biased projections, 4 groups of 2 experts (best 2)
    "lora-yarn": {
        "num_hidden_layers": 3,
        "rms_norm_eps": 1e-5,  # the latent norms keep 1e-6 regardless
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "rope_interleave": True,
        "rope_parameters": YARN,
        "attention_bias": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    # DeepSeek-V3's latent geometry (512 + 64), plain q_proj, default RoPE, tied embeddings
    "plain-512": {
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64,
        "v_head_dim": 16,
        "rope_interleave": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
    },
}


def make_hf(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = randomize(transformers.DeepseekV3ForCausalLM(hf_config(variant)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF initialises this buffer to zeros, which would hide the bias path
        for name, bias in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(0.15 * torch.randn(bias.shape, generator=generator))
    return hf


def hf_config(variant: str) -> Any:
    return transformers.DeepseekV3Config(**COMMON, **CONFIGS[variant])


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


@torch.no_grad()
def test_cached_latents_equal_hf_cache(pair: Any) -> None:
    """After the same prompt, ContiguousAttention holds HF DynamicCache's c_kv (keys, after
    `kv_a_layernorm`) and k_pe (values, after RoPE), layer by layer: layer 0's to the bit; later
    layers' inputs carry the earlier layers' absorbed-attention rounding (measured up to 2.6e-6
    on latents up to 3.7, about 10 float32 ulps), hence LATER_LATENT_TOL."""
    hf, model = pair
    ids = random_ids(11)
    out = hf(ids[None], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    attn = ContiguousAttention.for_config(model.config)
    model(ids, torch.arange(11), attn)
    config = model.config
    for layer_id, layer in enumerate(cache.layers):
        assert layer.keys.shape == (1, 1, 11, config.kv_lora_rank)
        assert layer.values.shape == (1, 1, 11, config.qk_rope_head_dim)
        ours_c_kv, ours_k_pe = attn.keys[layer_id], attn.values[layer_id]
        assert ours_c_kv is not None and ours_k_pe is not None
        tol = 0.0 if layer_id == 0 else LATER_LATENT_TOL
        torch.testing.assert_close(ours_c_kv, layer.keys[0].transpose(0, 1), atol=tol, rtol=0)
        torch.testing.assert_close(ours_k_pe, layer.values[0].transpose(0, 1), atol=tol, rtol=0)


@pytest.mark.parametrize(
    ("variant", "latent", "rope"), [("lora-yarn", 16, 8), ("plain-512", 512, 64)]
)
def test_attention_gets_absorbed_query_and_latents(
    variant: str, latent: int, rope: int, tmp_path: Path
) -> None:
    """The `AttentionFn` contract for MLA: q [T, heads, latent + rope], k = c_kv [T, 1, latent],
    v = k_pe [T, 1, rope], output [T, heads, latent]; the KV spec says the same."""
    model = save_and_load(make_hf(variant), tmp_path)
    num_layers = model.config.num_layers
    spec = LayerSpec(MLA, latent_dim=latent, rope_dim=rope)
    assert model.config.kv_layers() == (spec,) * num_layers
    attn = ContiguousAttention.for_config(model.config)
    shapes: list[tuple[tuple[int, ...], ...]] = []

    def spy(layer_id: int, q: torch.Tensor, k: Any, v: Any) -> torch.Tensor:
        out = attn(layer_id, q, k, v)
        shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(out.shape)))
        return out

    with torch.no_grad():
        model(random_ids(3), torch.arange(3), spy)
    want = ((3, 4, latent + rope), (3, 1, latent), (3, 1, rope), (3, 4, latent))
    assert shapes == [want] * num_layers


def test_yarn_tables_and_scale_equal_hf(pair: Any) -> None:
    """RoPE inverse frequencies to the bit, cos/sin factor and softmax scale as HF's."""
    hf, model = pair
    assert torch.equal(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model.cos_sin_factor == hf.model.rotary_emb.attention_scaling
    assert model.config.softmax_scale == hf.model.layers[0].self_attn.scaling


def test_yarn_moves_both_factors_off_one() -> None:
    """The lora-yarn variant exercises YaRN's two corrections, not a no-op."""
    config = read_deepseek_v3_config(hf_config("lora-yarn").to_dict())
    assert config.rope_scaling is not None
    assert config.rope_scaling.cos_sin_factor > 1.01
    assert config.rope_scaling.softmax_factor > 1.01


@torch.no_grad()
def test_correction_bias_changes_routing(pair: Any) -> None:
    """The randomised e_score_correction_bias picks other experts than the scores alone."""
    _, model = pair
    x = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    gate = model.layers[-1].mlp.gate
    with_bias, _ = gate(x)
    saved = gate.e_score_correction_bias.clone()
    gate.e_score_correction_bias.zero_()
    without_bias, _ = gate(x)
    gate.e_score_correction_bias.copy_(saved)
    assert not torch.equal(with_bias.sort(dim=-1).values, without_bias.sort(dim=-1).values)


def test_v4_rope_scaling_spelling_reads_the_same() -> None:
    """DeepSeek's own config.json (transformers 4 style: rope_theta + rope_scaling with `type`)."""
    raw = hf_config("lora-yarn").to_dict()
    v4 = {k: v for k, v in raw.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    v4 |= {"rope_theta": 10000.0, "rope_scaling": {**scaling, "type": "yarn"}}
    assert read_deepseek_v3_config(v4) == read_deepseek_v3_config(raw)


def test_multi_token_prediction_layers_are_skipped() -> None:
    config = read_deepseek_v3_config(hf_config("lora-yarn").to_dict())
    assert deepseek_v3_weight_name(config, "model.layers.3.eh_proj.weight") is None
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    assert deepseek_v3_weight_name(config, name) == "layers.2.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"rope_parameters": {**YARN, "factor": None}}, "factor"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ],
)
def test_bad_configs_raise(change: dict[str, Any], message: str) -> None:
    raw = hf_config("lora-yarn").to_dict()
    with pytest.raises(CheckpointError, match=message):
        read_deepseek_v3_config({**raw, **change})


def test_deepseek_v2_is_refused_by_name() -> None:
    """V2 routes by softmax without the correction bias: not the same model, so not read as V3."""
    raw = {**hf_config("lora-yarn").to_dict(), "model_type": "deepseek_v2"}
    with pytest.raises(UnknownArchitectureError, match="deepseek_v2"):
        read_hf_config(raw)


def test_load_model_builds_it(tmp_path: Path) -> None:
    hf = make_hf("lora-yarn")
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert isinstance(loaded.model, DeepseekV3Model)
    ids = random_ids(12)
    torch.testing.assert_close(
        our_logits(loaded.model, ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )


def test_bf16_keeps_the_router_in_fp32(tmp_path: Path) -> None:
    """As transformers does; bf16 logits then stay near HF's bf16 ones (measured 0.031, two bf16
    ulps at the logits' ~3; HF's own bf16 logits are 0.048 from its fp32 ones), hence 0.1."""
    hf = make_hf("lora-yarn")
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, "bf16", progress=False).build()
    gate = model.layers[-1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hf_bf16 = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = random_ids(24)
    got, want = our_logits(model, ids).float(), hf_logits(hf_bf16.eval(), ids).float()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0)
