"""The attention seam between the model and whoever owns the KV cache.

The model computes q/k/v (K already RoPE'd, HF `rotate_half` pairing) and hands them, one layer at
a time, to an `AttentionFn`; the callee stores K/V wherever it keeps them and returns the attention
output. `ContiguousAttention` is the plain reference: one sequence, K/V concatenated per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from kvabi.abi.descriptor import MLA, SHARED, LayerSpec
from kvabi.models.config import ModelConfig


class AttentionFn(Protocol):
    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, v_dim].

        K arrives post-RoPE; the callee stores K/V for `layer_id` and attends causally (within
        the layer's window, if its spec has one), scaling scores by 1/sqrt(head_dim): a model
        with another scale folds it into q. A layer that shares an earlier layer's KV
        (`LayerSpec.shares`) passes k = v = None and attends to that layer's K/V.

        An MLA layer (`LayerSpec.kind == MLA`, DeepSeek) passes its latents: k = c_kv
        [T, 1, latent_dim] (after `kv_a_layernorm`), v = k_pe [T, 1, rope_dim] (after RoPE),
        which the callee stores as the layer's `latent` and `rope` planes; q is the absorbed
        query [T, num_heads, latent_dim + rope_dim] (q_nope through W_UK, then q_pe). Scores
        are q . [c_kv | k_pe] / sqrt(latent_dim + rope_dim), the values are c_kv: the result is
        [T, num_heads, latent_dim], which the model takes through W_UV.
        """
        ...


class ContiguousAttention:
    """Causal attention over one sequence whose whole history is kept in per-layer tensors.

    Each call appends the new K/V of `layer_id` and lets the new queries attend to everything kept
    so far: query t of a call is at position `num_cached + t`. A layer's `window` (Mistral,
    Gemma's sliding layers) limits a query to the last `window` keys, itself included; a shared
    layer reads its target's K/V; an MLA layer keeps its latents (`keys`: c_kv, `values`: k_pe,
    HF's DeepSeek cache) and attends over them absorbed. The reference the paged engine is
    tested against.
    """

    def __init__(self, layers: Sequence[LayerSpec]) -> None:
        if not layers:
            raise ValueError("layers: must not be empty")
        self.layers = tuple(layers)
        self.keys: list[torch.Tensor | None] = [None] * len(layers)
        self.values: list[torch.Tensor | None] = [None] * len(layers)

    @classmethod
    def for_config(cls, config: ModelConfig) -> ContiguousAttention:
        return cls(config.kv_layers())

    @property
    def num_tokens(self) -> int:
        """Tokens held by the last layer with KV, i.e. after a completed forward pass."""
        k = next((k for k in reversed(self.keys) if k is not None), None)
        return 0 if k is None else k.shape[0]

    def reset(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        spec = self.layers[layer_id]
        if spec.kind == SHARED:
            keys, values = self.keys[spec.shares], self.values[spec.shares]
            assert keys is not None and values is not None, "a shared layer ran before its target"
        else:
            assert k is not None and v is not None
            keys = self._append(self.keys, layer_id, k)  # [L, num_kv_heads, head_dim]
            values = self._append(self.values, layer_id, v)
        if spec.kind == MLA:  # keys: the latents c_kv, values: k_pe (as HF's cache keeps them)
            keys, values = torch.cat((keys, values), dim=-1), keys
        num_queries, num_keys = q.shape[0], keys.shape[0]
        is_causal = spec.window == 0 and num_queries == num_keys > 1  # SDPA's own mask
        mask = None if is_causal else causal_mask(num_queries, num_keys, spec.window, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [num_heads, T, head_dim]
            keys.transpose(0, 1).to(q.dtype),  # [num_kv_heads, L, head_dim]
            values.transpose(0, 1).to(q.dtype),
            attn_mask=mask,
            is_causal=is_causal,
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [T, num_heads, v_dim]

    @staticmethod
    def _append(store: list[torch.Tensor | None], layer_id: int, new: torch.Tensor) -> torch.Tensor:
        old = store[layer_id]
        store[layer_id] = new if old is None else torch.cat((old, new), dim=0)
        return store[layer_id]


def causal_mask(
    num_queries: int,
    num_keys: int,
    window: int,
    device: torch.device | None = None,
    first_key: int = 0,
) -> torch.Tensor | None:
    """[T, num_keys - first_key] bool, True = may attend, for queries at the last `num_queries`
    of `num_keys` positions over keys `first_key ..` (within `window`, if any); None for one
    query without a window, which sees every key."""
    if window == 0 and num_queries == 1:
        return None
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_pos = torch.arange(first_key, num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    return mask
