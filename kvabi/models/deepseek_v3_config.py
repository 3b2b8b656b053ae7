"""The shape of a DeepSeek-V3 decoder (`DeepseekV3Config`) and its reading from HF config.json.

DeepSeek-V3: multi-head latent attention (MLA: a shared latent c_kv of `kv_lora_rank` plus one
decoupled RoPE key of `qk_rope_head_dim` per token, optionally a low-rank query), plain or YaRN
RoPE (interleaved pairs when `rope_interleave`), SwiGLU MLPs on the first `first_k_dense_replace`
layers and a sigmoid-routed, group-limited MoE with shared experts after. DeepSeek V3.2
(`deepseek_v32`) adds a lightning indexer per layer (`index_n_heads` x `index_head_dim`), whose
top `index_topk` keys per query are the only ones its MLA attends to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvabi.abi.descriptor import MLA, LayerSpec
from kvabi.models.config import config_error, eos_ids
from kvabi.models.errors import CheckpointError
from kvabi.models.yarn import YarnScaling

_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "rope_theta", "rms_norm_eps")  # fmt: skip


@dataclass(frozen=True)
class DeepseekV3Config:
    """A DeepSeek-V3 decoder (`DeepseekV3ForCausalLM`). `q_lora_rank` None: a plain `q_proj`;
    `rope_scaling` None: default RoPE. Layers from `first_k_dense_replace` on are MoE."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "deepseek_v3"
    index_n_heads: int = 0  # deepseek_v32 only: the lightning indexer's heads, key width, top-k
    index_head_dim: int = 0
    index_topk: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise config_error(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.qk_rope_head_dim % 2:
            raise config_error("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise config_error("q_lora_rank", f"must be > 0 or None, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise config_error(
                "first_k_dense_replace", f"must be in [0, {self.num_layers}], got "
                f"{self.first_k_dense_replace}"
            )  # fmt: skip
        if self.architecture not in ("deepseek_v3", "deepseek_v32"):
            raise config_error(
                "architecture", f"{self.architecture!r} is not 'deepseek_v3' or 'deepseek_v32'"
            )
        if self.has_indexer or self.architecture == "deepseek_v32":
            self._check_indexer()
        if self.first_k_dense_replace < self.num_layers:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("moe_intermediate_size", "n_routed_experts", "n_group", "topk_group"):
            if getattr(self, name) <= 0:
                raise config_error(name, f"MoE layers need > 0, got {getattr(self, name)!r}")
        if self.n_shared_experts < 0:
            raise config_error("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        if self.n_routed_experts % self.n_group:
            raise config_error(
                "n_group", f"{self.n_group} must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_group > 1 and self.experts_per_group < 2:
            raise config_error("n_group", "groups are scored by their top 2: >= 2 experts each")
        if self.topk_group > self.n_group:
            raise config_error("topk_group", f"{self.topk_group} > n_group ({self.n_group})")
        if not 0 < self.num_experts_per_tok <= self.topk_group * self.experts_per_group:
            raise config_error(
                "num_experts_per_tok",
                f"must be in [1, {self.topk_group * self.experts_per_group}] (the experts of "
                f"topk_group groups), got {self.num_experts_per_tok}",
            )

    def _check_indexer(self) -> None:
        if self.architecture != "deepseek_v32":
            raise config_error("index_n_heads", "an indexer is DeepSeek V3.2's (deepseek_v32)")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) <= 0:
                raise config_error(name, f"DeepSeek V3.2 needs > 0, got {getattr(self, name)!r}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise config_error("index_head_dim", "must be >= qk_rope_head_dim (its RoPE part)")
        if self.q_lora_rank is None or not self.rope_interleave:
            raise config_error(
                "q_lora_rank", "DeepSeek V3.2 has a low-rank query and interleaved MLA RoPE"
            )

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """HF's `scaling`: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2."""
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_factor
        return self.qk_head_dim**-0.5 * factor

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What each layer caches: the latent c_kv and the RoPE key k_pe, one of each a token;
        DeepSeek V3.2 also its indexer key (the sidecar plane `indexer`)."""
        spec = LayerSpec(
            MLA,
            latent_dim=self.kv_lora_rank,
            rope_dim=self.qk_rope_head_dim,
            indexer_dim=self.index_head_dim if self.has_indexer else 0,
        )
        return (spec,) * self.num_layers


_REFUSED = {  # config.json key -> the values kvabi (and transformers' DeepseekV3) implement
    "hidden_act": ("silu",),
    "topk_method": ("noaux_tc",),
    "scoring_func": ("sigmoid",),
    "moe_layer_freq": (1,),
}


def _check_supported(raw: Mapping[str, Any]) -> None:
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")
    for key, supported in _REFUSED.items():
        if key in raw and raw[key] not in supported:
            raise CheckpointError(f"{key}: {raw[key]!r} not supported; supported: {supported}")


def _rope(raw: Mapping[str, Any]) -> tuple[float, YarnScaling | None]:
    params = raw.get("rope_parameters") or {
        "rope_theta": raw.get("rope_theta", 10000.0),
        **(raw.get("rope_scaling") or {}),
    }
    theta = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor: only 1.0 is supported for DeepSeek-V3")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"rope_type {rope_type!r} not supported; supported: default, yarn")
    if params.get("factor") is None:
        raise CheckpointError("rope_parameters.factor: YaRN needs a factor")
    yarn = YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings")
            or raw.get("max_position_embeddings", 4096)  # HF's default, as it standardizes
        ),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    return theta, yarn


def read_deepseek_v3_config(
    raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()
) -> DeepseekV3Config:
    """config.json of `deepseek_v3` -> DeepseekV3Config (HF's defaults where a key is missing)."""
    _check_supported(raw)
    theta, yarn = _rope(raw)
    return DeepseekV3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
        v_head_dim=raw.get("v_head_dim", 128),
        q_lora_rank=raw.get("q_lora_rank", 1536),
        rope_theta=theta,
        rope_scaling=yarn,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
        n_routed_experts=raw.get("n_routed_experts", 256),
        num_experts_per_tok=raw.get("num_experts_per_tok") or 8,
        n_shared_experts=raw.get("n_shared_experts", 1),
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        first_k_dense_replace=raw.get("first_k_dense_replace", 3),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), extra_eos),
    )


def read_deepseek_v32_config(
    raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()
) -> DeepseekV3Config:
    """config.json of `deepseek_v32` -> DeepseekV3Config with its indexer (HF's defaults).
    HF's V3.2 always uses a low-rank query and interleaved MLA RoPE (no `rope_interleave`)."""
    base = read_deepseek_v3_config({**raw, "rope_interleave": True}, extra_eos)
    layer_types = raw.get("mlp_layer_types")
    dense = base.first_k_dense_replace
    if layer_types is not None:
        dense = layer_types.count("dense")
        if layer_types != ["dense"] * dense + ["sparse"] * (base.num_layers - dense):
            raise CheckpointError(f"mlp_layer_types {layer_types!r}: only dense then sparse")
    return replace(
        base,
        architecture="deepseek_v32",
        first_k_dense_replace=dense,
        index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 2048),
    )


_LAYER = re.compile(r"^layers\.(\d+)\.")
# kept in float32 whatever the load dtype, as transformers keeps them: the router's choice of
# experts turns on small score differences
FP32_WEIGHTS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def deepseek_v3_weight_name(config: DeepseekV3Config, hf_name: str) -> str | None:
    """A checkpoint name -> `DeepseekV3Model` name (without `model.`); None for the multi-token
    prediction layers past `num_layers` (which HF ignores too). Per-expert weights are left for
    `merge_expert_weights`."""
    name = hf_name.removeprefix("model.")
    match = _LAYER.match(name)
    if match is not None and int(match[1]) >= config.num_layers:
        return None
    return name
