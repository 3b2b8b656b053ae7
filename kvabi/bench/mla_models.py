"""Random-weight DeepSeek-V3 checkpoints for `kvabi bench mla`: transformers' own model class,
saved as an HF folder with a byte-level tokenizer, so kvabi loads it as it loads any checkpoint.

Every shape keeps DeepSeek-V3's latent geometry (kv_lora_rank 512 + qk_rope_head_dim 64, so the
cache is the real 576 values / 656-byte record per token); the rest is sized to run on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvabi.models.tokenizer import write_byte_level_tokenizer

VOCAB = 96  # printable ASCII (94) + <s> + </s>, as the byte tokenizer below


@dataclass(frozen=True)
class MLAShape:
    num_layers: int
    hidden: int
    num_heads: int
    intermediate: int
    nope_dim: int = 128  # DeepSeek-V3's qk_nope_head_dim and v_head_dim
    v_dim: int = 128

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden, self.num_heads, self.intermediate) < 1:
            raise ValueError(f"MLAShape: every size must be >= 1, got {self}")

    def hf_config(self) -> dict[str, Any]:
        """DeepseekV3Config arguments: dense MLPs (no experts), plain q_proj, default RoPE."""
        return {
            "vocab_size": VOCAB,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": self.nope_dim,
            "v_head_dim": self.v_dim,
            "first_k_dense_replace": self.num_layers,  # every layer's MLP dense
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "max_position_embeddings": 4096,
            "bos_token_id": 94,
            "eos_token_id": 95,
            "tie_word_embeddings": False,
        }


def random_deepseek_v3(shape: MLAShape, folder: Path, seed: int = 0) -> Any:
    """transformers' DeepseekV3ForCausalLM with random weights (norms around 1, the rest around
    0 with std `0.5 / sqrt(fan_in)`, so activations keep their scale through the layers and the
    logits are far from uniform), saved with a tokenizer under `folder`; returns it (fp32)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape.hf_config()))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            if "norm" in name:
                tensor.copy_(1.0 + 0.1 * noise)
            else:
                tensor.copy_(noise * (0.5 if tensor.dim() == 1 else tensor.shape[-1] ** -0.5))
    hf.eval()
    hf.save_pretrained(folder)
    write_byte_level_tokenizer(folder)
    return hf


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of `length` random ids among the printable ones."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 94, (num, length), generator=generator).tolist()
