"""DeepSeek V4's RoPE and RMSNorm, equal to transformers 5.24's (`DeepseekV4RotaryEmbedding`,
`apply_rotary_pos_emb`, `DeepseekV4RMSNorm`).

V4 rotates only the trailing `rope_dim` channels of a vector, in interleaved pairs
(2i, 2i + 1) kept in place; cos/sin hold one angle per pair. Two tables: "main" (the sliding
layers, plain RoPE) and "compress" (the compressed layers, their compressors and indexers:
another base, YaRN in DeepSeek's checkpoints, cos/sin unscaled). The norms keep float32 weights
and multiply in float32 before casting back, unlike Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvabi.models.rope import default_inv_freq
from kvabi.models.yarn import YarnScaling


class V4Rope(nn.Module):
    """cos/sin [T, rope_dim / 2] at given positions (`inv_freq` a plain float32 attribute)."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> None:
        super().__init__()
        self.inv_freq = default_inv_freq(rope_dim, theta) if yarn is None else yarn.inv_freq(
            rope_dim, theta
        )  # fmt: skip
        # HF's V4 leaves YaRN's cos/sin factor at 1.0 unless the config sets attention_factor
        self.factor = 1.0 if yarn is None else yarn.cos_sin_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def apply_v4_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos/sin broadcastable to [..., rope_dim / 2]: the last rope_dim channels
    rotated in interleaved pairs, in float32, the rest kept."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class V4RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
