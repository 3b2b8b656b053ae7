"""A loaded model -> an HF checkpoint folder, so foreign engines (vLLM, transformers) run our model.

Llama, Mistral and Qwen2 (`ModelConfig`), and Gemma 3 text (`Gemma3Config`, written as
`Gemma3ForCausalLM`: a GGUF of Gemma 3 becomes a folder vLLM loads, which it cannot from GGUF).

The folder holds `config.json`, `model.safetensors` (weights in the loaded dtype, HF names),
`tokenizer.json`, `tokenizer_config.json` (special tokens, chat template) and
`generation_config.json`. It reloads bit-identically: transformers gives our logits, and our own
`load_model(folder)` reads it back. Needs `safetensors` (the `hf` extra), imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvabi.models.config import ModelConfig, RopeScaling
from kvabi.models.gemma3_config import FULL, SLIDING, Gemma3Config
from kvabi.models.registry import LoadedModel

# our architecture -> (HF model_type, HF class)
HF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}


def _check_expressible(config: ModelConfig) -> None:
    """HF configs have fewer bias switches than ours: refuse what they cannot say."""
    if config.architecture == "qwen2":
        wanted = (True, False, False)  # q/k/v bias only, implied by the type
        has = (config.attention_bias, config.attention_out_bias, config.mlp_bias)
        if has != wanted:
            raise ValueError(
                f"qwen2: biases (qkv, o, mlp) {has} cannot be written; HF implies {wanted}"
            )
    elif config.attention_bias != config.attention_out_bias:
        raise ValueError(
            f"{config.architecture}: attention_bias={config.attention_bias} with "
            f"attention_out_bias={config.attention_out_bias}: HF has a single attention_bias"
        )
    if config.architecture == "mistral" and (config.attention_bias or config.mlp_bias):
        raise ValueError("mistral: HF's Mistral has no biases")


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    scaling: RopeScaling | None = config.rope_scaling
    params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if scaling is not None:
        params.update(rope_type=scaling.rope_type, factor=scaling.factor)
    if scaling is not None and scaling.rope_type == "llama3":
        params.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return params


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _geometry(config: ModelConfig | Gemma3Config) -> dict[str, Any]:
    """The fields every HF decoder config spells alike: sizes and head counts."""
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }


def _vocabulary(config: ModelConfig | Gemma3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The vocabulary, special tokens and weight dtype, spelled alike by every HF config."""
    return {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
        "torch_dtype": _dtype_name(dtype),
    }


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def gemma3_hf_config(config: Gemma3Config, dtype: torch.dtype) -> dict[str, Any]:
    """`Gemma3Config` -> config.json of `Gemma3ForCausalLM` (`gemma3_text`, transformers 5's
    per-layer-type `rope_parameters`, plus 4's `rope_theta` / `rope_local_base_freq`)."""
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        full.update(rope_type=config.rope_scaling.rope_type, factor=config.rope_scaling.factor)
    sliding = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_geometry(config),
        "hidden_activation": config.hidden_activation,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window or 0,
        "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar),  # HF: an int
        "rope_parameters": {FULL: full, SLIDING: sliding},
        "rope_theta": config.rope_theta,
        "rope_local_base_freq": config.rope_local_base_freq,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        **_vocabulary(config, dtype),
    }


def hf_config(config: ModelConfig | Gemma3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The model's config -> config.json contents (transformers 5 spelling, plus 4's
    `rope_theta`). Llama, Mistral, Qwen2 and Gemma 3 text; others are refused."""
    if isinstance(config, Gemma3Config):
        return gemma3_hf_config(config, dtype)
    if config.architecture not in HF_ARCHITECTURES:
        raise ValueError(
            f"{config.architecture}: no HF export (supported: "
            f"{', '.join([*HF_ARCHITECTURES, 'gemma3'])})"
        )
    _check_expressible(config)
    model_type, class_name = HF_ARCHITECTURES[config.architecture]
    raw: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        **_geometry(config),
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        **_vocabulary(config, dtype),
    }
    if model_type == "llama":
        raw.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    if model_type == "mistral":
        raw["sliding_window"] = config.sliding_window
    return raw


def hf_state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Our parameter names -> HF's: `model.` before everything but `lm_head` (absent if tied)."""
    out = {}
    for name, tensor in loaded.model.state_dict().items():
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        out[hf_name] = tensor.detach().clone()  # own storage: fused projections are views
    return out


def _tokenizer_config(loaded: LoadedModel) -> dict[str, Any]:
    tokenizer = loaded.tokenizer
    raw: dict[str, Any] = {
        # Use tokenizer.json as written (its pre-tokenizer and BOS post-processor included).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": loaded.config.max_position_embeddings,
        **tokenizer.special_tokens,
    }
    if tokenizer.chat_template is not None:
        raw["chat_template"] = tokenizer.chat_template.source
    return raw


def _generation_config(loaded: LoadedModel) -> dict[str, Any]:
    return {
        "bos_token_id": loaded.config.bos_token_id,
        "eos_token_id": _one_or_list(loaded.stop_token_ids),
    }


def _write_json(path: Path, raw: dict[str, Any]) -> None:
    path.write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_hf_folder(loaded: LoadedModel, out_dir: Path) -> Path:
    """Write `loaded` as an HF checkpoint folder at `out_dir` (created if missing); return it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", hf_config(loaded.config, loaded.model.dtype))
    save_file(hf_state_dict(loaded), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(loaded))
    _write_json(out_dir / "generation_config.json", _generation_config(loaded))
    return out_dir
