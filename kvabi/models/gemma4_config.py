"""The shape of a Gemma 4 text decoder (`Gemma4Config`) and its reading from HF `config.json`.

Gemma 4 mixes two layer types: `sliding_attention` layers (`head_dim`, `num_kv_heads`, window
`sliding_window`) and `full_attention` layers (`global_head_dim`, `num_global_kv_heads`), each
type with its own RoPE. The last `num_kv_shared_layers` layers compute no K/V: each reads the
K/V of the last earlier layer of its type (HF `kv_sharing_modes` "reuse" / "store").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvabi.abi.descriptor import ATTN, SHARED, LayerSpec
from kvabi.models.config import check_layer_types, config_error, eos_ids
from kvabi.models.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA4_LAYER_TYPES = (SLIDING, FULL)
GEMMA4_ROPE_TYPES = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh",)
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "global_head_dim", "num_global_kv_heads")  # fmt: skip


@dataclass(frozen=True)
class Gemma4Rope:
    """One layer type's RoPE. `proportional` rotates only the first `partial_rotary_factor` of
    the head_dim/2 frequency pairs (the rest get frequency 0); `default` rotates all."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in GEMMA4_ROPE_TYPES:
            raise config_error("rope_type", f"{self.rope_type!r} not in {GEMMA4_ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise config_error(
                "theta", f"theta and factor must be > 0, got {self.theta}, {self.factor}"
            )
        if not 0.0 <= self.partial_rotary_factor <= 1.0:
            raise config_error(
                "partial_rotary_factor", f"must be in [0, 1], got {self.partial_rotary_factor}"
            )


@dataclass(frozen=True)
class Gemma4Config:
    """A Gemma 4 text decoder (`Gemma4ForCausalLM`, or the text part of Gemma 4).

    `hidden_size_per_layer_input` > 0 enables the per-layer embeddings (PLE); `num_experts` > 0
    the MoE block beside each layer's MLP; `use_double_wide_mlp` doubles the MLP of shared
    layers. `sliding_window` is None when no layer slides.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    global_head_dim: int
    num_global_kv_heads: int
    sliding_window: int | None
    sliding_rope: Gemma4Rope = Gemma4Rope()
    full_rope: Gemma4Rope = Gemma4Rope("proportional", 1e6, 0.25)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    hidden_activation: str = "gelu_pytorch_tanh"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "gemma4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise config_error(name, f"must be > 0, got {getattr(self, name)!r}")
        self._check_layers()
        self._check_options()
        self.kv_sharing_modes()  # raises where a shared layer type has no store layer

    def _check_layers(self) -> None:
        check_layer_types(
            self.layer_types, self.num_layers, self.sliding_window, GEMMA4_LAYER_TYPES, SLIDING
        )
        for i in range(self.num_layers):
            if self.num_heads % self.layer_kv_heads(i) or self.layer_head_dim(i) % 2:
                raise config_error(
                    "num_kv_heads", f"layer {i}: heads must divide, head_dim be even"
                )
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise config_error("num_kv_shared_layers", f"must be in [0, {self.num_layers})")

    def _check_options(self) -> None:
        if self.hidden_activation not in ACTIVATIONS:
            raise config_error(
                "hidden_activation", f"{self.hidden_activation!r} not in {ACTIVATIONS}"
            )
        if self.hidden_size_per_layer_input < 0 or (
            self.hidden_size_per_layer_input and self.vocab_size_per_layer_input <= 0
        ):
            raise config_error(
                "hidden_size_per_layer_input", "PLE needs vocab_size_per_layer_input > 0"
            )
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise config_error("top_k_experts", f"must be in [1, {self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise config_error("moe_intermediate_size", "must be > 0 with experts")
        if self.architecture != "gemma4":
            raise config_error("architecture", f"{self.architecture!r} is not 'gemma4'")

    def is_sliding(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == SLIDING

    def layer_head_dim(self, layer_id: int) -> int:
        return self.head_dim if self.is_sliding(layer_id) else self.global_head_dim

    def layer_kv_heads(self, layer_id: int) -> int:
        return self.num_kv_heads if self.is_sliding(layer_id) else self.num_global_kv_heads

    def layer_window(self, layer_id: int) -> int:
        return self.sliding_window or 0 if self.is_sliding(layer_id) else 0

    def layer_rope(self, layer_id: int) -> Gemma4Rope:
        return self.sliding_rope if self.is_sliding(layer_id) else self.full_rope

    def has_k_eq_v(self, layer_id: int) -> bool:
        """Full-attention layers of `attention_k_eq_v` models have no v_proj: V is made from
        k_proj's output (value-normed, without RoPE), so K and V still differ."""
        return self.attention_k_eq_v and not self.is_sliding(layer_id)

    def kv_sharing_modes(self) -> tuple[str | None, ...]:
        """Per layer, as HF's `kv_sharing_modes`: "reuse" (reads another layer's K/V), "store"
        (the last non-shared layer of its type) or None."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        modes: list[str | None] = [None] * first_shared + ["reuse"] * self.num_kv_shared_layers
        for layer_type in set(self.layer_types):
            own = [i for i in range(first_shared) if self.layer_types[i] == layer_type]
            if not own:
                raise config_error(
                    "num_kv_shared_layers", f"no earlier {layer_type} layer to share"
                )
            modes[own[-1]] = "store"
        return tuple(modes)

    def kv_source(self, layer_id: int) -> int:
        """The layer whose K/V `layer_id` attends to: itself, or its type's store layer."""
        modes = self.kv_sharing_modes()
        if modes[layer_id] != "reuse":
            return layer_id
        layer_type = self.layer_types[layer_id]
        return next(
            i for i, m in enumerate(modes) if m == "store" and self.layer_types[i] == layer_type
        )

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What each layer caches: own K/V at its own geometry, or SHARED with its store layer."""
        specs = []
        for i in range(self.num_layers):
            window, source = self.layer_window(i), self.kv_source(i)
            if source != i:
                specs.append(LayerSpec(SHARED, shares=source, window=window))
            else:
                dim = self.layer_head_dim(i)
                specs.append(LayerSpec(ATTN, self.layer_kv_heads(i), dim, dim, window=window))
        return tuple(specs)


def _rope(raw: Mapping[str, Any], layer_type: str) -> Gemma4Rope:
    params = (raw.get("rope_parameters") or {}).get(layer_type)
    if params is None:  # HF's defaults
        return Gemma4Rope() if layer_type == SLIDING else Gemma4Rope("proportional", 1e6, 0.25)
    rope_type = params.get("rope_type", "default")
    if rope_type not in GEMMA4_ROPE_TYPES:
        raise CheckpointError(
            f"rope_type {rope_type!r} not supported; supported: {GEMMA4_ROPE_TYPES}"
        )
    fraction = params.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0
    factor = params.get("factor", 1.0) if rope_type == "proportional" else 1.0
    return Gemma4Rope(rope_type, float(params["rope_theta"]), float(fraction), float(factor))


def _layer_types(raw: Mapping[str, Any]) -> list[str]:
    num_layers = raw["num_hidden_layers"]
    types = list(
        raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    )
    types[-1] = FULL  # as HF, which forces (and warns) when the last layer is not full attention
    return types


def _global_geometry(raw: Mapping[str, Any], layer_types: list[str]) -> tuple[int, int]:
    """(global_head_dim, num_global_kv_heads) from `per_layer_config` (as transformers >= 5.24
    saves it) or from `global_head_dim` / `num_global_key_value_heads` (as older ones did)."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v", True) else None
        return raw.get("global_head_dim", 512), kv or raw["num_key_value_heads"]
    overrides = {int(i): dict(v) for i, v in per_layer.items()}
    full = [i for i, t in enumerate(layer_types) if t == FULL]
    wanted = overrides.get(full[0], {}) if full else {}
    if set(overrides) - set(full) or any(overrides.get(i, {}) != wanted for i in full):
        raise CheckpointError(
            "per_layer_config: only equal overrides on all full layers are supported"
        )
    if set(wanted) - {"head_dim", "num_key_value_heads"}:
        raise CheckpointError(f"per_layer_config: unsupported overrides {sorted(wanted)}")
    return wanted.get("head_dim", raw["head_dim"]), wanted.get(
        "num_key_value_heads", raw["num_key_value_heads"]
    )


def _check_supported(raw: Mapping[str, Any]) -> None:
    if raw.get("use_bidirectional_attention") == "all":
        raise CheckpointError("use_bidirectional_attention: 'all' (non-causal) is not supported")
    if raw.get("attention_bias"):
        raise CheckpointError("attention_bias: not supported for Gemma 4")
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")


def read_gemma4_config(raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()) -> Gemma4Config:
    """config.json of `gemma4_text` (or of `gemma4`, whose `text_config` it reads)."""
    if raw.get("model_type") == "gemma4":
        raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **raw["text_config"]}
    _check_supported(raw)
    layer_types = _layer_types(raw)
    global_head_dim, num_global_kv_heads = _global_geometry(raw, layer_types)
    return Gemma4Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        layer_types=tuple(layer_types),
        global_head_dim=global_head_dim,
        num_global_kv_heads=num_global_kv_heads,
        sliding_window=raw.get("sliding_window", 512) if SLIDING in layer_types else None,
        sliding_rope=_rope(raw, SLIDING),
        full_rope=_rope(raw, FULL),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        num_kv_shared_layers=raw.get("num_kv_shared_layers", 0),
        hidden_size_per_layer_input=raw.get("hidden_size_per_layer_input", 256) or 0,  # HF default
        vocab_size_per_layer_input=raw.get("vocab_size_per_layer_input", 262144) or 0,
        use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        num_experts=(raw.get("num_experts") or 0) if raw.get("enable_moe_block") else 0,
        top_k_experts=raw.get("top_k_experts") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        hidden_activation=raw.get("hidden_activation", "gelu_pytorch_tanh"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), extra_eos),
    )


_NOT_TEXT = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
_SHARED_LAYER_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


def gemma4_weight_name(config: Gemma4Config, hf_name: str) -> str | None:
    """HF name -> `Gemma4Model` name (without `model.language_model.` or `model.`); None for
    what the text model does not use: the vision and audio towers and their embedders, and the
    k/v projections and norms of KV-shared layers, which HF drops on load too."""
    if hf_name.startswith("lm_head."):
        return None if config.tie_word_embeddings else hf_name
    name = hf_name.removeprefix("model.language_model.")
    if name == hf_name:
        name = hf_name.removeprefix("model.")
    if name.startswith(_NOT_TEXT) or name == hf_name:
        return None
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 3 and parts[3] in _SHARED_LAYER_WEIGHTS:
        layer_id = int(parts[1])
        return None if config.kv_source(layer_id) != layer_id else name
    return name
