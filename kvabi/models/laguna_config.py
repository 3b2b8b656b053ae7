"""The shape of a Laguna decoder (`LagunaConfig`, poolside) and its reading from HF config.json.

Laguna: per-layer query heads (`num_heads_per_layer`) over a fixed KV geometry, sliding and full
layers with their own RoPE (theta, rotated fraction), a softplus output gate per head (or per
element), q/k RMSNorm, and a sigmoid-routed MoE with one shared expert on `sparse` layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.models.config import config_error, eos_ids
from kvabi.models.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
LAGUNA_LAYER_TYPES = (SLIDING, FULL)
MLP_TYPES = ("dense", "sparse")
GATINGS = ("per-head", "per-element")


@dataclass(frozen=True)
class LagunaRope:
    """One layer type's RoPE: plain RoPE over the first `partial_rotary_factor` of head_dim."""

    theta: float
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.theta <= 0 or not 0.0 < self.partial_rotary_factor <= 1.0:
            raise config_error("rope", f"theta > 0 and fraction in (0, 1], got {self}")


@dataclass(frozen=True)
class LagunaConfig:
    """A Laguna decoder (`LagunaForCausalLM`). `sliding_window` is None when no layer slides."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads_per_layer: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    sliding_window: int | None
    sliding_rope: LagunaRope = LagunaRope(10000.0)
    full_rope: LagunaRope = LagunaRope(500000.0, 0.5)
    gating: str = "per-head"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_routed_scaling_factor: float = 1.0
    moe_router_logit_softcapping: float = 0.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "laguna"

    def __post_init__(self) -> None:
        for name in ("num_heads_per_layer", "layer_types", "mlp_layer_types", "eos_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_kv_heads", "head_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise config_error(name, f"must be > 0, got {getattr(self, name)!r}")
        for name in ("num_heads_per_layer", "layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != self.num_layers:
                raise config_error(
                    name, f"{len(getattr(self, name))} entries for {self.num_layers} layers"
                )
        if any(n <= 0 or n % self.num_kv_heads for n in self.num_heads_per_layer):
            raise config_error(
                "num_heads_per_layer", f"each a multiple of {self.num_kv_heads} KV heads"
            )
        self._check_types()
        self._check_moe()

    def _check_types(self) -> None:
        if set(self.layer_types) - set(LAGUNA_LAYER_TYPES):
            raise config_error("layer_types", f"{self.layer_types} not all in {LAGUNA_LAYER_TYPES}")
        if set(self.mlp_layer_types) - set(MLP_TYPES):
            raise config_error("mlp_layer_types", f"{self.mlp_layer_types} not all in {MLP_TYPES}")
        if (SLIDING in self.layer_types) != (self.sliding_window is not None):
            raise config_error("sliding_window", "must be set exactly when some layer slides")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise config_error("sliding_window", f"must be > 0, got {self.sliding_window}")
        if self.gating not in GATINGS:
            raise config_error("gating", f"{self.gating!r} not in {GATINGS}")
        if self.architecture != "laguna":
            raise config_error("architecture", f"{self.architecture!r} is not 'laguna'")

    def _check_moe(self) -> None:
        if "sparse" not in self.mlp_layer_types:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise config_error(
                "num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
            raise config_error("moe_intermediate_size", "sparse layers need expert sizes > 0")

    def is_sliding(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == SLIDING

    def layer_window(self, layer_id: int) -> int:
        return self.sliding_window or 0 if self.is_sliding(layer_id) else 0

    def layer_rope(self, layer_id: int) -> LagunaRope:
        return self.sliding_rope if self.is_sliding(layer_id) else self.full_rope

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What each layer caches: the same K/V geometry everywhere, windowed on sliding layers
        (the query heads vary by layer; the KV cache does not)."""
        dim = self.head_dim
        return tuple(
            LayerSpec(ATTN, self.num_kv_heads, dim, dim, window=self.layer_window(i))
            for i in range(self.num_layers)
        )


def _rope(raw: Mapping[str, Any], layer_type: str) -> LagunaRope:
    defaults = {SLIDING: {"rope_theta": 10000.0}, FULL: {"rope_theta": 500000.0,
                "partial_rotary_factor": 0.5}}  # fmt: skip
    params = (raw.get("rope_parameters") or {}).get(layer_type) or defaults[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(
            f"rope_type {rope_type!r} not supported for Laguna; supported: default"
        )
    return LagunaRope(float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0)))


def _gating(value: bool | str) -> str:
    if value is True or value == "per-head":
        return "per-head"
    if value == "per-element":
        return "per-element"
    raise CheckpointError(
        f"gating: {value!r} not supported; supported: true, per-head, per-element"
    )


def read_laguna_config(raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()) -> LagunaConfig:
    """config.json of `laguna` -> LagunaConfig (HF's defaults where a key is missing)."""
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act: {raw['hidden_act']!r} not supported; supported: silu")
    if raw.get("moe_apply_router_weight_on_input"):
        raise CheckpointError(
            "moe_apply_router_weight_on_input: not supported (nor by transformers)"
        )
    num_layers = raw["num_hidden_layers"]
    layer_types = tuple(raw.get("layer_types") or [FULL] * num_layers)
    heads = raw.get("num_attention_heads_per_layer") or [raw["num_attention_heads"]] * num_layers
    return LagunaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads_per_layer=tuple(heads),
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        layer_types=layer_types,
        mlp_layer_types=tuple(
            raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        ),
        sliding_window=raw.get("sliding_window", 512) if SLIDING in layer_types else None,
        sliding_rope=_rope(raw, SLIDING),
        full_rope=_rope(raw, FULL),
        gating=_gating(raw.get("gating", True)),
        num_experts=raw.get("num_experts", 256),
        num_experts_per_tok=raw.get("num_experts_per_tok", 8),
        moe_intermediate_size=raw.get("moe_intermediate_size", 512),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 512),
        moe_routed_scaling_factor=float(raw.get("moe_routed_scaling_factor", 1.0)),
        moe_router_logit_softcapping=float(raw.get("moe_router_logit_softcapping") or 0.0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), extra_eos),
    )


# checkpoint name -> HF model name (transformers' conversion mapping for laguna, on load)
_RENAMES = (
    ("mlp.experts.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    ("mlp.shared_expert.", "mlp.shared_experts."),
)


def laguna_weight_name(hf_name: str) -> str:
    """A checkpoint name -> `LagunaModel` name (without `model.`); per-expert weights are left
    for `merge_expert_weights`."""
    name = hf_name.removeprefix("model.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name
