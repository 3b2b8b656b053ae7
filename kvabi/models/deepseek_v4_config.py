"""The shape of a DeepSeek V4 decoder (`DeepseekV4Config`) and its reading from HF config.json.

DeepSeek V4 (transformers 5.24 `DeepseekV4ForCausalLM`): every layer attends over a sliding
window of one shared K=V head (`head_dim` wide, RoPE on its trailing `qk_rope_head_dim`
channels, interleaved pairs), plus, on compressed layers, entries that each pool `m` tokens:
- `compressed_sparse_attention` (CSA, m = `compress_rates[...]`, 4 in DeepSeek's): each entry
  pools two adjacent windows (overlap), and a lightning indexer picks each query's top
  `index_topk` entries;
- `heavily_compressed_attention` (HCA, m' = 128 in DeepSeek's): non-overlapping windows, every
  entry visible;
- `sliding_attention`: the window alone.
Attention adds a learned sink per head, and its output goes through a grouped low-rank
projection. The residual is `hc_mult` streams mixed by hyper-connections (mHC, Sinkhorn), and
every MLP is an MoE (`hash_moe`: experts fixed per token id; `moe`: top-k by
`sqrt(softplus)` scores) with one shared expert, SwiGLU clamped at `swiglu_limit`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvabi.abi.descriptor import ATTN, CENTRIES, LayerSpec
from kvabi.models.config import config_error, eos_ids
from kvabi.models.deepseek_v3_config import _rope
from kvabi.models.errors import CheckpointError
from kvabi.models.yarn import YarnScaling

SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid")  # HF has no "softmax" activation to route by
_POSITIVE = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_layers", "num_heads",
             "head_dim", "q_lora_rank", "qk_rope_head_dim", "n_routed_experts",
             "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "sliding_window",
             "o_groups", "o_lora_rank")  # fmt: skip


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int = 4  # m: tokens pooled per CSA entry
    hca_rate: int = 128  # m': tokens pooled per HCA entry
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0  # the sliding layers' ("main") RoPE
    compress_rope_theta: float = 160000.0  # the compressed layers' ("compress") RoPE
    compress_rope_scaling: YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "deepseek_v4"

    def __post_init__(self) -> None:
        for name in ("layer_types", "mlp_layer_types", "eos_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise config_error(name, f"must be > 0, got {getattr(self, name)!r}")
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES),
        ):
            if len(types) != self.num_layers or not set(types) <= set(allowed):
                raise config_error(name, f"{self.num_layers} of {allowed}, got {list(types)}")
        self._check_geometry()
        if CSA in self.layer_types:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if getattr(self, name) <= 0:
                    raise config_error(name, f"CSA layers need > 0, got {getattr(self, name)}")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise config_error("index_head_dim", "must be >= qk_rope_head_dim (its RoPE)")

    def _check_geometry(self) -> None:
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise config_error(
                "qk_rope_head_dim", f"must be even and <= head_dim, got {self.qk_rope_head_dim}"
            )
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise config_error("o_groups", f"must divide num_heads * head_dim, got {self}")
        if self.scoring_func not in SCORING:
            raise config_error("scoring_func", f"{self.scoring_func!r} is not one of {SCORING}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise config_error("num_experts_per_tok", "more than n_routed_experts")
        for name in ("csa_rate", "hca_rate"):
            if getattr(self, name) < 1:
                raise config_error(name, f"must be >= 1, got {getattr(self, name)}")

    def compress_rate(self, layer_id: int) -> int:
        """Tokens pooled per entry of layer `layer_id` (0: a sliding layer, no entries)."""
        kind = self.layer_types[layer_id]
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What the cache holds (ABI 1.4): per layer its window's K=V head (stored as K and V:
        `head_dim` each, window `sliding_window`), then per compressed layer, in layer order,
        its entries (`centries`: one per m tokens, the indexer's beside them on CSA, which
        also keeps its overlap state per block)."""
        d = self.head_dim
        window = LayerSpec(ATTN, 1, d, d, window=self.sliding_window)
        entries = tuple(
            LayerSpec(
                CENTRIES,
                latent_dim=d,
                indexer_dim=self.index_head_dim if kind == CSA else 0,
                compresses=i,
                ratio=self.compress_rate(i),
                overlap=kind == CSA,
            )  # fmt: skip
            for i, kind in enumerate(self.layer_types)
            if kind != SLIDING
        )
        return (window,) * self.num_layers + entries


def read_deepseek_v4_config(
    raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()
) -> DeepseekV4Config:
    """config.json of `deepseek_v4` -> DeepseekV4Config (HF's defaults where a key is missing,
    its legacy keys folded in as HF folds them)."""
    _check_supported(raw)
    n = raw.get("num_hidden_layers", 43)
    head_dim = raw.get("head_dim", 512)
    rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
    rates[CSA] = raw.get("compress_rate_csa", rates[CSA])
    rates[HCA] = raw.get("compress_rate_hca", rates[HCA])
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        factor = raw.get("qk_rope_head_dim", 64) / head_dim
    main, compress = _rope_tables(raw, factor)
    return DeepseekV4Config(
        vocab_size=raw.get("vocab_size", 129280),
        hidden_size=raw.get("hidden_size", 4096),
        moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
        num_layers=n,
        num_heads=raw.get("num_attention_heads", 64),
        head_dim=head_dim,
        q_lora_rank=raw.get("q_lora_rank", 1024),
        qk_rope_head_dim=int(head_dim * factor),
        layer_types=_layer_types(raw, n),
        mlp_layer_types=_mlp_types(raw, n),
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        n_routed_experts=raw.get("n_routed_experts", 256),
        num_experts_per_tok=raw.get("num_experts_per_tok", 6),
        scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        sliding_window=raw.get("sliding_window", 128),
        o_groups=raw.get("o_groups", 8),
        o_lora_rank=raw.get("o_lora_rank", 1024),
        index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512),
        rope_theta=main,
        compress_rope_theta=compress[0],
        compress_rope_scaling=compress[1],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 1048576),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 1), extra_eos),
    )


_FP32_MODULES = ("attn_hc", "ffn_hc", "hc_head")
_FP32_ENDINGS = ("sinks", "position_bias", "e_score_correction_bias", "norm.weight")


def keeps_fp32(name: str) -> bool:
    """Whether transformers keeps this V4 weight in float32 whatever the load dtype (its
    `_keep_in_fp32_modules_strict`: the mixes, sinks, position biases, router bias, norms)."""
    return any(part in _FP32_MODULES for part in name.split(".")) or name.endswith(_FP32_ENDINGS)


_REFUSED = {  # config.json key -> the values kvabi (and transformers' DeepseekV4) implement
    "hidden_act": ("silu",),
    "num_key_value_heads": (1,),  # shared-KV MQA: one K=V head
    "n_shared_experts": (1,),  # HF builds one shared expert of moe_intermediate_size
    "attention_bias": (False,),
    "mlp_bias": (False,),
}


def _check_supported(raw: Mapping[str, Any]) -> None:
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")
    for key, supported in _REFUSED.items():
        if key in raw and raw[key] not in supported:
            raise CheckpointError(f"{key}: {raw[key]!r} not supported; supported: {supported}")


def _layer_types(raw: Mapping[str, Any], n: int) -> list[str]:
    """HF's order: `layer_types`, else legacy `compress_ratios` (0/4/128 per layer), else
    V4-Pro's default (two HCA layers, then CSA and HCA alternating)."""
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
        types = [by_ratio[r] for r in raw["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return list(types[:n])


def _mlp_types(raw: Mapping[str, Any], n: int) -> list[str]:
    types = raw.get("mlp_layer_types")
    if types is None:
        num_hash = raw.get("num_hash_layers", 3)
        types = ["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash)
    return list(types[:n])


def _rope_tables(raw: Mapping[str, Any], factor: float) -> tuple[float, tuple]:
    """(main theta, (compress theta, compress YaRN or None)). HF nests them under
    `rope_parameters.main` / `.compress`; a flat `rope_parameters` is the compress table's
    scaling, with `rope_theta` and `compress_rope_theta` as the bases."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {"rope_type": "default", **flat}
        compress["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
        if compress.get("rope_type") == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for table in (main, compress):
        if table.get("partial_rotary_factor", factor) != factor:
            raise CheckpointError("rope_parameters: the tables' partial_rotary_factor differ")
    if main.get("rope_type", "default") != "default":
        raise CheckpointError("rope_parameters.main: only default RoPE on the sliding layers")
    plain = {k: v for k, v in compress.items() if k != "partial_rotary_factor"}
    context = raw.get("max_position_embeddings", 1048576)  # YaRN's default original context
    compressed = _rope({"rope_parameters": plain, "max_position_embeddings": context})
    return float(main.get("rope_theta", 10000.0)), compressed


# DeepSeek's own checkpoint names -> HF's (transformers' conversion_mapping for deepseek_v4,
# in its order; `save_pretrained` writes DeepSeek's names back); per-expert w1/w3/w2 become
# gate/up/down for `merge_expert_weights`
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
]


def deepseek_v4_weight_name(hf_name: str) -> str | None:
    """A checkpoint name (DeepSeek's or HF's, with or without `model.`: `save_pretrained`
    writes a mix) -> `DeepseekV4Model`'s; None for the multi-token prediction layers
    (`mtp.`), which HF skips too."""
    hf_name = hf_name.removeprefix("model.")  # transformers writes some names with it
    if hf_name.startswith("mtp."):
        return None
    for pattern, replacement in _RENAMES:  # HF's own names pass unchanged
        hf_name = re.sub(pattern, replacement, hf_name)
    return hf_name
