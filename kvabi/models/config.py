"""The shape of a Llama-family decoder (`ModelConfig`) and its RoPE scaling (`RopeScaling`).

Both are frozen and validated at construction; a bad value raises `CheckpointError` (a
ValueError) naming the field.
Loaders (`gguf_loader`, `hf_loader`) translate a checkpoint's own vocabulary into these.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.models.errors import CheckpointError

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_SCALING_TYPES = ("linear", "llama3")


def config_error(field_name: str, message: str) -> CheckpointError:
    """The error a bad config value raises: `CheckpointError("<field>: <message>")`."""
    return CheckpointError(f"{field_name}: {message}")


def check_layer_types(
    layer_types: tuple[str, ...],
    num_layers: int,
    sliding_window: int | None,
    known: tuple[str, ...],
    sliding: str = "sliding_attention",
) -> None:
    """One known type per layer, and a window > 0 set exactly when some layer slides."""
    if len(layer_types) != num_layers:
        raise config_error("layer_types", f"{len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - set(known)
    if unknown:
        raise config_error("layer_types", f"{sorted(unknown)} not in {known}")
    if (sliding in layer_types) != (sliding_window is not None):
        raise config_error("sliding_window", "must be set exactly when some layer slides")
    if sliding_window is not None and sliding_window <= 0:
        raise config_error("sliding_window", f"must be > 0, got {sliding_window}")


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF config's token id field (one id, a list of them, or absent) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def eos_ids(value: int | list[int] | None, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """config.json's EOS ids, then those of `extra` (generation_config.json's) it lacks."""
    ids = token_ids(value)
    return ids + tuple(i for i in extra if i not in ids)


def _require_positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise config_error(name, f"must be > 0, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF `rope_parameters` describes it.

    `linear` divides every inverse frequency by `factor`. `llama3` (Llama 3.1+) leaves wavelengths
    below `original_max_position_embeddings / high_freq_factor` alone, divides those above
    `original_max_position_embeddings / low_freq_factor` by `factor`, and interpolates between.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise config_error("rope_type", f"{self.rope_type!r} not in {ROPE_SCALING_TYPES}")
        _require_positive(self, ("factor",))
        if self.rope_type == "llama3":
            _require_positive(
                self, ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            )
            if self.high_freq_factor <= self.low_freq_factor:
                raise config_error(
                    "high_freq_factor",
                    f"must exceed low_freq_factor ({self.low_freq_factor}), "
                    f"got {self.high_freq_factor}",
                )


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: Llama 2/3, SmolLM2, Mistral (llama shape) and Qwen2 (QKV bias).

    `attention_bias` puts a bias on q/k/v (Qwen2, and Llama's `attention_bias`);
    `attention_out_bias` on o_proj (Llama's `attention_bias` only); `mlp_bias` on the MLP.
    `sliding_window` is recorded for the attention backend; the model itself never masks.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        _require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "rope_theta",
                "rms_norm_eps",
                "max_position_embeddings",
            ),
        )
        self._check_heads()
        self._check_token_ids()
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise config_error("sliding_window", f"must be > 0 or None, got {self.sliding_window}")
        if self.architecture not in ARCHITECTURES:
            raise config_error("architecture", f"{self.architecture!r} not in {ARCHITECTURES}")

    def _check_heads(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise config_error(
                "num_kv_heads",
                f"{self.num_kv_heads} must divide num_heads ({self.num_heads}) for GQA",
            )
        if self.head_dim % 2:
            raise config_error("head_dim", f"must be even for RoPE, got {self.head_dim}")

    def _check_token_ids(self) -> None:
        ids = (() if self.bos_token_id is None else (self.bos_token_id,)) + self.eos_token_ids
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                name = "bos_token_id" if token_id == self.bos_token_id else "eos_token_ids"
                raise config_error(
                    name, f"{token_id} outside the vocabulary [0, {self.vocab_size})"
                )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What each layer caches (the descriptor's layer specs): a Llama-family model has one
        kind of layer, windowed when `sliding_window` is set (Mistral)."""
        dim, window = self.head_dim, self.sliding_window or 0
        return (LayerSpec(ATTN, self.num_kv_heads, dim, dim, window=window),) * self.num_layers
