"""`Decoder`: what every kvabi model shares, whatever its layers.

Built from a complete state dict without random init; `forward` is `compute_logits` over
`hidden_states`; logits go through `lm_head`, or the input embedding when the model ties them
(no `lm_head` parameter then). Models without fused or packed paths (Gemma 4, Laguna) keep the
no-op `fuse_projections` / `use_kernels`; `LlamaModel` overrides them.
"""

from __future__ import annotations

from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.cpu_kernels import CpuKernels


class Decoder(nn.Module):
    embed_tokens: nn.Embedding
    lm_head: nn.Linear | None

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor]) -> Self:
        """Build without random init; all parameters must be present, dtype/device as given."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state_dict, strict=True, assign=True)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def logit_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: `lm_head`'s, or the tied embedding's."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.logit_weight)  # [num_tokens, vocab_size]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions, attn))

    def fuse_projections(self, pack: bool = True, kernels: CpuKernels | None = None) -> Self:
        """No fused or packed GEMMs: plain torch throughout."""
        return self

    def use_kernels(self, kernels: CpuKernels | None) -> Self:
        """No fused CPU kernels."""
        return self
