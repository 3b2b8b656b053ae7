"""The shape of a Gemma 3 text decoder (`Gemma3Config`) and its reading from HF `config.json`.

Gemma 3 has two layer types of one geometry: `sliding_attention` layers (window
`sliding_window`, RoPE theta `rope_local_base_freq`) and `full_attention` layers (theta
`rope_theta`, plus linear scaling on the larger models). By default every 6th layer is full.
Attention scores are scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.models.config import RopeScaling, check_layer_types, config_error, eos_ids
from kvabi.models.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_LAYER_TYPES = (SLIDING, FULL)
SLIDING_WINDOW_PATTERN = 6  # HF's and llama.cpp's default: layer i is full when (i + 1) % 6 == 0
ACTIVATIONS = ("gelu_pytorch_tanh",)
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "query_pre_attn_scalar", "rope_theta",
             "rope_local_base_freq", "rms_norm_eps")  # fmt: skip


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(
        FULL if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else SLIDING for i in range(num_layers)
    )


@dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 text decoder (`Gemma3ForCausalLM`, or the text part of Gemma 3).

    `rope_scaling` applies to the full layers only (HF puts `rope_scaling` there);
    `sliding_window` is None when no layer slides.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    query_pre_attn_scalar: float = 256.0
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "gemma3"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise config_error(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise config_error("num_kv_heads", "must divide num_heads, and head_dim be even")
        check_layer_types(
            self.layer_types, self.num_layers, self.sliding_window, GEMMA3_LAYER_TYPES, SLIDING
        )
        if self.hidden_activation not in ACTIVATIONS:
            raise config_error(
                "hidden_activation", f"{self.hidden_activation!r} not in {ACTIVATIONS}"
            )
        if self.architecture != "gemma3":
            raise config_error("architecture", f"{self.architecture!r} is not 'gemma3'")

    def is_sliding(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == SLIDING

    def layer_window(self, layer_id: int) -> int:
        return (self.sliding_window or 0) if self.is_sliding(layer_id) else 0

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """Every layer caches its own K/V, one geometry; sliding layers with their window."""
        dim = self.head_dim
        return tuple(
            LayerSpec(ATTN, self.num_kv_heads, dim, dim, window=self.layer_window(i))
            for i in range(self.num_layers)
        )


def _full_rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of the full layers, from transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling`."""
    params = (raw.get("rope_parameters") or {}).get(FULL) or {
        "rope_theta": raw.get("rope_theta", 1_000_000.0),
        **(raw.get("rope_scaling") or {}),
    }
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 1_000_000.0))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    raise CheckpointError(
        f"rope_type {rope_type!r} not supported for Gemma 3; supported: default, linear"
    )


def _local_theta(raw: Mapping[str, Any]) -> float:
    params = (raw.get("rope_parameters") or {}).get(SLIDING) or {}
    if params.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"sliding rope_type {params['rope_type']!r}: only 'default' is supported"
        )
    return float(params.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))


def _check_supported(raw: Mapping[str, Any]) -> None:
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if raw.get(key):
            raise CheckpointError(f"{key}: not supported for Gemma 3")
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")


def read_gemma3_config(raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()) -> Gemma3Config:
    """config.json of `gemma3_text` (or of `gemma3`, whose `text_config` it reads)."""
    if raw.get("model_type") == "gemma3":
        raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **raw["text_config"]}
    _check_supported(raw)
    num_layers = raw["num_hidden_layers"]
    layer_types = tuple(raw.get("layer_types") or default_layer_types(num_layers))
    theta, scaling = _full_rope(raw)
    return Gemma3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim", 256),
        layer_types=layer_types,
        sliding_window=raw.get("sliding_window", 4096) if SLIDING in layer_types else None,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        rope_theta=theta,
        rope_local_base_freq=_local_theta(raw),
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        hidden_activation=raw.get("hidden_activation", "gelu_pytorch_tanh"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), extra_eos),
    )


# where the text model's weights sit: Gemma3ForCausalLM; Gemma3ForConditionalGeneration as
# transformers 5 names it in memory; as it (and Google's checkpoints) save it
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def gemma3_weight_name(config: Gemma3Config, hf_name: str) -> str | None:
    """HF name -> `Gemma3Model` name; None for the vision tower and projector, and for a tied
    `lm_head`."""
    if hf_name.removeprefix("language_model.").startswith("lm_head."):
        return None if config.tie_word_embeddings else hf_name.removeprefix("language_model.")
    prefix = max((p for p in _TEXT_PREFIXES if hf_name.startswith(p)), key=len, default=None)
    if prefix is None or hf_name.startswith(("model.vision_tower.", "model.multi_modal")):
        return None
    return hf_name.removeprefix(prefix)
