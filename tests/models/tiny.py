"""Tiny random HF reference models (2 layers, GQA, head_dim 16, vocab 96) and helpers."""

from __future__ import annotations

from typing import Any

import torch

from kvabi.models import ContiguousAttention, LlamaModel

TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # puts 2 of the 8 frequencies in the smoothed band
}


def make_hf(arch: str = "llama", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random HF model whose every weight (norms and biases included) is non-trivial."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(centre + 0.15 * torch.randn_like(param))
    return model.eval()


def random_ids(num_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, TINY["vocab_size"], (num_tokens,), generator=torch.Generator().manual_seed(seed)
    )


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0]  # [num_tokens, vocab_size]


@torch.no_grad()
def our_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    attn = ContiguousAttention.for_config(model.config)
    return model(ids, torch.arange(ids.shape[0]), attn)


@torch.no_grad()
def our_logits_incremental(model: LlamaModel, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill `prefill` tokens, then decode the rest one token per forward pass."""
    attn = ContiguousAttention.for_config(model.config)
    rows = [model(ids[:prefill], torch.arange(prefill), attn)]
    for pos in range(prefill, ids.shape[0]):
        rows.append(model(ids[pos : pos + 1], torch.tensor([pos]), attn))
    return torch.cat(rows)
