"""A bank of gated MLP experts kept as 3D tensors, as HF keeps them (Gemma 4, Laguna).

`gate_up_proj` [num_experts, 2 * inner, hidden] and `down_proj` [num_experts, hidden, inner];
expert e computes down(act(gate) * up). Plain torch, one loop over the experts in use, in HF's
order (ascending expert, then routing slot, then token), so sums agree with HF's to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def clamp_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V4's clipped SwiGLU inputs: gate <= limit, |up| <= limit (None: unclipped)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


class SiluMLP(nn.Module):
    """One gated MLP, `down(silu(gate(x)) * up(x))`, HF's names (Laguna's and DeepSeek-V3's
    dense layers and shared experts; DeepSeek V4's with its inputs clipped at `limit`)."""

    def __init__(self, hidden_size: int, inner_size: int, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.down_proj = nn.Linear(inner_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        inner_size: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        limit: float | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner_size))
        self.act, self.limit = act, limit

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; top_k_index, top_k_weights [T, k] -> sum over the k routed experts of
        weight * expert(x), [T, hidden]."""
        out = torch.zeros_like(x)
        for expert_id in torch.unique(top_k_index).tolist():  # ascending
            slots, token_ids = torch.where(top_k_index.T.eq(expert_id))  # [slot, token] order
            gate, up = F.linear(x[token_ids], self.gate_up_proj[expert_id]).chunk(2, dim=-1)
            gate, up = clamp_swiglu(gate, up, self.limit)
            h = F.linear(self.act(gate) * up, self.down_proj[expert_id])  # [n, hidden]
            h = h * top_k_weights[token_ids, slots, None]
            out.index_add_(0, token_ids, h.to(out.dtype))
        return out
