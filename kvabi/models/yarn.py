"""YaRN RoPE scaling (`YarnScaling`): inverse frequencies and the two magnitude corrections.

YaRN keeps the frequencies that turn more than `beta_fast` times over the original context,
divides those turning fewer than `beta_slow` times by `factor`, and blends linearly between;
cos/sin are scaled by `attention_factor`, and DeepSeek also multiplies its softmax scale by
`mscale(factor, mscale_all_dim)^2`. The formulas follow HF transformers' `_compute_yarn_parameters`
step for step (float32, same operation order), so cos/sin agree with HF's to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvabi.models.config import config_error


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """HF `rope_type: yarn`. `attention_factor` None: derived from factor, mscale and
    mscale_all_dim as HF derives it; `truncate` rounds the blend range outwards."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if getattr(self, name) <= 0:
                raise config_error(f"rope_parameters.{name}", f"must be > 0, got {self!r}")
        if self.beta_fast <= self.beta_slow:
            raise config_error("rope_parameters.beta_fast", f"must exceed beta_slow, got {self}")

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (HF's `attention_scaling`)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What DeepSeek multiplies its softmax scale by: mscale(factor, mscale_all_dim)^2."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """[dim // 2] float32 inverse frequencies of a `dim`-wide rotary part."""
        steps = torch.arange(0, dim, 2, device="cpu").to(torch.float)
        pos_freqs = theta ** (steps / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        low, high = self._blend_range(dim, theta)
        if low == high:
            high += 0.001  # as HF: no zero-width ramp
        index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
        ramp = ((index - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by factor
        return interpolation * (1 - keep) + extrapolation * keep

    def _blend_range(self, dim: int, theta: float) -> tuple[float, float]:
        def dim_of(num_turns: float) -> float:  # the dim whose wave turns num_turns times
            turns = self.original_max_position_embeddings / (num_turns * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)
