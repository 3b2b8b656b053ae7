"""The attention seam between the model and whoever owns the KV cache.

The model computes q/k/v (K already RoPE'd, HF `rotate_half` pairing) and hands them, one layer at
a time, to an `AttentionFn`; the callee stores K/V wherever it keeps them and returns the attention
output. `ContiguousAttention` is the plain reference: one sequence, K/V concatenated per layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvabi.models.config import ModelConfig


class AttentionFn(Protocol):
    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].

        K arrives post-RoPE; the callee stores K/V for `layer_id` and attends causally.
        """
        ...


class ContiguousAttention:
    """Causal attention over one sequence whose whole history is kept in per-layer tensors.

    Each call appends the new K/V of `layer_id` and lets the new queries attend to everything kept
    so far: query t of a call is at position `num_cached + t`. `sliding_window` (Mistral) limits a
    query to the last `sliding_window` keys, itself included.
    """

    def __init__(self, num_layers: int, sliding_window: int | None = None) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers: must be > 0, got {num_layers}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window: must be > 0 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @classmethod
    def for_config(cls, config: ModelConfig) -> ContiguousAttention:
        return cls(config.num_layers, config.sliding_window)

    @property
    def num_tokens(self) -> int:
        """Tokens held for the last layer, i.e. after a completed forward pass."""
        k = self.keys[-1]
        return 0 if k is None else k.shape[0]

    def reset(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        keys = self._append(self.keys, layer_id, k)  # [L, num_kv_heads, head_dim]
        values = self._append(self.values, layer_id, v)
        num_queries, num_keys = q.shape[0], keys.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [num_heads, T, head_dim]
            keys.transpose(0, 1),  # [num_kv_heads, L, head_dim]
            values.transpose(0, 1),
            attn_mask=self._mask(num_queries, num_keys, q.device),
            is_causal=self._is_plain_causal(num_queries, num_keys),
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [T, num_heads, head_dim]

    @staticmethod
    def _append(store: list[torch.Tensor | None], layer_id: int, new: torch.Tensor) -> torch.Tensor:
        old = store[layer_id]
        store[layer_id] = new if old is None else torch.cat((old, new), dim=0)
        return store[layer_id]

    def _is_plain_causal(self, num_queries: int, num_keys: int) -> bool:
        return self.sliding_window is None and num_queries == num_keys > 1

    def _mask(self, num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor | None:
        """[T, L] bool, True = may attend; None where `is_causal` or no mask says it all."""
        if self._is_plain_causal(num_queries, num_keys):
            return None
        if self.sliding_window is None and num_queries == 1:
            return None  # one new query sees every key
        query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
        key_pos = torch.arange(num_keys, device=device)[None, :]
        mask = key_pos <= query_pos
        if self.sliding_window is not None:
            mask &= key_pos > query_pos - self.sliding_window
        return mask
