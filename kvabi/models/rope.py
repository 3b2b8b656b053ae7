"""Rotary position embedding with HF `rotate_half` pairing (dim i rotates with i + head_dim/2).

Inverse frequencies follow HF transformers' formulas step for step (float32, same operation
order), so cos/sin agree with HF to the last bit and fp32 logits to ~1e-6. llama.cpp stores
Llama-3 scaling as per-frequency divisors (`rope_freqs.weight`); `fit_llama3_scaling` recovers
the `RopeScaling` that produces them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from kvabi.models.config import RopeScaling


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # Built on the CPU even under a `torch.device("meta")` context (models are made on meta).
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    exponents = steps.to(torch.float) / head_dim
    return 1.0 / (theta**exponents)  # [head_dim // 2]


def scaled_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def llama3_freq_factors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs.weight` for this scaling."""
    inv_freq = default_inv_freq(head_dim, theta).double()
    return (inv_freq / _llama3_inv_freq(inv_freq, scaling)).float().numpy()


def fit_llama3_scaling(
    freq_factors: np.ndarray, head_dim: int, theta: float, original_context: int
) -> RopeScaling:
    """Solve for the Llama-3 scaling whose divisors are `freq_factors`.

    The divisors depend on original_context only through its ratios to the two freq factors, so
    `original_context` is taken as given (the file's, else Llama 3's 8192) and the two factors
    follow from the medium band, where 1/divisor = (1 - s)/factor + s and s is linear in
    original_context/wavelength. The fit is checked by regenerating the divisors.
    """
    factors = np.asarray(freq_factors, dtype=np.float64)
    factor = float(factors.max())
    wavelen = 2 * math.pi / default_inv_freq(head_dim, theta).double().numpy()
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1 or medium.sum() < 2:
        raise ValueError(
            "rope_freqs.weight: need >= 2 divisors strictly between 1 and the maximum to fit "
            f"Llama-3 scaling, got {np.round(factors, 4).tolist()}"
        )
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    # s * high + (1 - s) * low = original_context / wavelen, for each medium frequency
    lhs = np.stack([1 - smooth, smooth], axis=1)
    (low, high), *_ = np.linalg.lstsq(lhs, original_context / wavelen[medium], rcond=None)
    scaling = RopeScaling("llama3", factor, float(low), float(high), original_context)
    _check_fit(factors, llama3_freq_factors(head_dim, theta, scaling))
    return scaling


def _check_fit(expected: np.ndarray, fitted: np.ndarray) -> None:
    error = float(np.max(np.abs(fitted / expected - 1)))
    if error > 1e-4:
        raise ValueError(
            f"rope_freqs.weight: not Llama-3 scaling (best fit is off by {error:.2e} relative)"
        )


class FrequencyRope(nn.Module):
    """cos/sin [T, 2 * len(inv_freq)] for given positions, from explicit inverse frequencies.

    `inv_freq` is a plain float32 attribute, not a buffer, so `model.to(torch.bfloat16)` cannot
    round it; it follows the positions to their device on first use.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq  # [rotary_dim // 2], float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class RotaryEmbedding(FrequencyRope):
    """Llama-family RoPE over the whole head, with its frequency scaling."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__(scaled_inv_freq(head_dim, theta, scaling))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, num_heads, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
