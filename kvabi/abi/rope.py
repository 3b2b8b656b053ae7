"""The RoPE pairing permutation of K's head dims.

HF (and NEOX) rotate dims (i, i + r/2); llama.cpp's Llama K rotates adjacent pairs (2i, 2i+1)
because its converter permuted the K projection rows. Per head, pairs element 2i + a equals half
element a*(r/2) + i, for a in {0, 1}, i < r/2; dims past r (partial rotary) are not moved.
"""

from __future__ import annotations

import torch


def permute_pairing(k: torch.Tensor, src: str, dst: str, rope_dim: int = 0) -> torch.Tensor:
    """Reorder the last axis of `k` [..., head_dim] from pairing `src` to `dst`."""
    if src == dst:
        return k
    r = rope_dim or k.shape[-1]
    rot, rest = k[..., :r], k[..., r:]
    if src == "half":  # (2, r/2) -> (r/2, 2)
        rot = rot.unflatten(-1, (2, r // 2)).transpose(-1, -2).flatten(-2)
    else:  # pairs -> half: (r/2, 2) -> (2, r/2)
        rot = rot.unflatten(-1, (r // 2, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat([rot, rest], dim=-1)
