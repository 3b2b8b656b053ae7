"""HF checkpoint folder (config.json + *.safetensors) -> `Checkpoint`.

Reads both config spellings: transformers 5's `rope_parameters` and 4's `rope_theta` +
`rope_scaling`. Weights keep HF names minus the `model.` prefix. Needs `safetensors` (the `hf`
extra), imported only when a folder is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvabi.models.checkpoint import AnyConfig, Checkpoint, parse_dtype
from kvabi.models.config import ModelConfig, RopeScaling, eos_ids, token_ids
from kvabi.models.deepseek_v3_config import (
    FP32_WEIGHTS,
    DeepseekV3Config,
    deepseek_v3_weight_name,
    read_deepseek_v3_config,
    read_deepseek_v32_config,
)
from kvabi.models.deepseek_v4_config import (
    DeepseekV4Config,
    deepseek_v4_weight_name,
    keeps_fp32,
    read_deepseek_v4_config,
)
from kvabi.models.errors import CheckpointError, MissingFieldError, UnknownArchitectureError
from kvabi.models.expert_weights import merge_expert_weights
from kvabi.models.gemma3_config import Gemma3Config, gemma3_weight_name, read_gemma3_config
from kvabi.models.gemma4_config import Gemma4Config, gemma4_weight_name, read_gemma4_config
from kvabi.models.laguna_config import LagunaConfig, laguna_weight_name, read_laguna_config

# model_type -> its own config reader; the rest are the Llama family, read here
OWN_READERS = {
    "deepseek_v3": read_deepseek_v3_config,
    "deepseek_v32": read_deepseek_v32_config,
    "deepseek_v4": read_deepseek_v4_config,
    "gemma3": read_gemma3_config,
    "gemma3_text": read_gemma3_config,
    "gemma4": read_gemma4_config,
    "gemma4_text": read_gemma4_config,
    "laguna": read_laguna_config,
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", *OWN_READERS)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found: {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {
        "rope_theta": raw.get("rope_theta", 10000.0),
        **(raw.get("rope_scaling") or {}),
    }
    theta = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, RopeScaling("llama3", *(params[k] for k in keys))
    raise CheckpointError(
        f"rope_type {rope_type!r} not supported; supported: default, linear, llama3"
    )


def _biases(raw: Mapping[str, Any], model_type: str) -> dict[str, bool]:
    if model_type == "qwen2":  # q/k/v carry a bias, o_proj and the MLP do not
        return {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}
    bias = bool(raw.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": bool(raw.get("mlp_bias", False)),
    }


def _sliding_window(raw: Mapping[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2":
        if raw.get("use_sliding_window"):
            raise CheckpointError("use_sliding_window: per-layer sliding windows are not supported")
        return None
    return raw.get("sliding_window") if model_type == "mistral" else None


def read_hf_config(raw: Mapping[str, Any], extra_eos: tuple[int, ...] = ()) -> AnyConfig:
    """config.json contents -> ModelConfig (or the architecture's own config); `extra_eos`
    comes from generation_config.json. An unknown `model_type` or a missing key raises a
    `CheckpointError` naming it."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise MissingFieldError("config.json: 'model_type' is missing")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnknownArchitectureError(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    try:
        return OWN_READERS.get(model_type, _read_llama_config)(raw, extra_eos)
    except KeyError as e:
        raise MissingFieldError(
            f"config.json: {e.args[0]!r} is missing (model_type {model_type!r})"
        ) from e


def _read_llama_config(raw: Mapping[str, Any], extra_eos: tuple[int, ...]) -> ModelConfig:
    """The Llama family (llama, mistral, qwen2)."""
    model_type = raw["model_type"]
    if raw.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized HF checkpoints are not supported")
    num_heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(raw, model_type),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), extra_eos),
        architecture=model_type,
        **_biases(raw, model_type),
    )


def load_hf_config(folder: str | Path) -> AnyConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"HF checkpoint folder not found: {folder}")
    generation = folder / "generation_config.json"
    extra = token_ids(_read_json(generation).get("eos_token_id")) if generation.is_file() else ()
    return read_hf_config(_read_json(folder / "config.json"), extra)


def _our_name(hf_name: str, config: AnyConfig) -> str | None:
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if isinstance(config, Gemma3Config):
        return gemma3_weight_name(config, hf_name)
    if isinstance(config, Gemma4Config):
        return gemma4_weight_name(config, hf_name)
    if isinstance(config, LagunaConfig):
        return laguna_weight_name(hf_name)
    if isinstance(config, DeepseekV3Config):
        return deepseek_v3_weight_name(config, hf_name)
    if isinstance(config, DeepseekV4Config):
        return deepseek_v4_weight_name(hf_name)
    return hf_name.removeprefix("model.")


def _as_loaded(
    tensor: torch.Tensor, name: str, config: AnyConfig, dtype: torch.dtype
) -> torch.Tensor:
    """A weight in the load dtype; integer tables (V4's `tid2eid`) as they are, and the weights
    transformers keeps in float32 (routers, V4's norms, mixes and sinks) in float32."""
    if not tensor.is_floating_point():
        return tensor
    if isinstance(config, DeepseekV3Config) and name.endswith(FP32_WEIGHTS):
        return tensor.to(torch.float32)
    if isinstance(config, DeepseekV4Config) and keeps_fp32(name):
        return tensor.to(torch.float32)
    return tensor.to(dtype)


def load_hf(
    folder: str | Path, dtype: str | torch.dtype = "fp32", progress: bool = True
) -> Checkpoint:
    """Read an HF Llama/Mistral/Qwen2/Gemma 3/Gemma 4/Laguna/DeepSeek-V3 folder into a `Checkpoint`
    (fp32/bf16)."""
    from safetensors import safe_open

    config = load_hf_config(folder)
    torch_dtype = parse_dtype(dtype)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state_dict: dict[str, torch.Tensor] = {}
    bar = tqdm(desc="Loading safetensors", unit="tensor", disable=not progress)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                name = _our_name(key, config)
                if name is not None:
                    state_dict[name] = _as_loaded(f.get_tensor(key), name, config, torch_dtype)
                bar.update()
    bar.close()
    if isinstance(config, LagunaConfig | DeepseekV3Config | DeepseekV4Config):
        state_dict = merge_expert_weights(state_dict)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return Checkpoint(config, state_dict)
