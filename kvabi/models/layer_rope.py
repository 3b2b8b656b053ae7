"""Inverse frequencies (for `rope.FrequencyRope`) of models whose layer types differ in RoPE.

Gemma 4 and Laguna give each layer type its own theta and rotated fraction. The formulas follow
HF transformers' step for step (float32, same operation order), so cos/sin agree to the bit.
"""

from __future__ import annotations

import torch

from kvabi.models.rope import apply_rope


def proportional_inv_freq(
    head_dim: int, theta: float, fraction: float = 1.0, factor: float = 1.0
) -> torch.Tensor:
    """HF `proportional` RoPE (Gemma 4): the first `fraction` of the head_dim/2 frequency pairs
    rotate as in plain RoPE over the whole head_dim; the others get frequency 0 (cos 1, sin 0).
    fraction 1, factor 1 is plain RoPE."""
    num_rotated = int(fraction * head_dim // 2)
    steps = torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64, device="cpu").to(torch.float)
    rotated = 1.0 / (theta ** (steps / head_dim))
    zeros = torch.zeros(head_dim // 2 - num_rotated, dtype=torch.float32, device="cpu")
    return torch.cat((rotated, zeros)) / factor  # [head_dim // 2]


def partial_inv_freq(head_dim: int, theta: float, fraction: float) -> torch.Tensor:
    """HF partial RoPE (Laguna): plain RoPE over the first int(head_dim * fraction) dims only,
    which rotate among themselves (rotate_half within that slice); the rest pass through."""
    dim = int(head_dim * fraction)
    steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
    return 1.0 / (theta ** (steps / dim))  # [dim // 2]


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim]: rotate the first rotary_dim dims."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    rotated = apply_rope(x[..., :rotary_dim], cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
