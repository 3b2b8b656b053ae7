"""The attention seam of DeepSeek V3.2's sparse attention: an `AttentionFn` that also keeps
each layer's indexer keys (the sidecar plane `indexer`) and takes the indexer's selection.

`ContiguousSparseAttention` is its plain reference: `ContiguousAttention` plus a per-layer
tensor of indexer keys (HF's `cache.update_indexer`), and MLA attention limited to the keys
the indexer picked.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvabi.abi.descriptor import MLA
from kvabi.models.attention import ContiguousAttention, causal_mask
from kvabi.models.errors import CheckpointError


class SparseAttentionFn(Protocol):
    def update_indexer(self, layer_id: int, keys: torch.Tensor) -> torch.Tensor:
        """Append keys [T, index_head_dim] to layer `layer_id`'s indexer cache; return all of
        them [L, index_head_dim], in position order."""
        ...

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `AttentionFn`; `keep` [T, L] bool (L: the keys after this call's) limits query t
        to the keys it marks (within causality)."""
        ...


def require_sparse(attn: object) -> None:
    """Refuse an attention that would drop the indexer keys (and the sparsity with them)."""
    if not callable(getattr(attn, "update_indexer", None)):
        raise CheckpointError(
            f"DeepSeek V3.2 needs an attention that keeps the indexer keys (update_indexer), "
            f"e.g. ContiguousSparseAttention; got {type(attn).__name__}"
        )


class ContiguousSparseAttention(ContiguousAttention):
    """One sequence's latents and indexer keys, whole, per layer (`indexer_keys[layer]`
    [L, index_head_dim] is HF's indexer cache of that layer)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.indexer_keys: list[torch.Tensor | None] = [None] * len(self.layers)

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = [None] * len(self.layers)

    def update_indexer(self, layer_id: int, keys: torch.Tensor) -> torch.Tensor:
        return self._append(self.indexer_keys, layer_id, keys)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if keep is None:
            return super().__call__(layer_id, q, k, v)
        if self.layers[layer_id].kind != MLA or k is None or v is None:
            raise ValueError(f"layer {layer_id}: a keep mask is for MLA layers with their KV")
        c_kv = self._append(self.keys, layer_id, k)  # [L, 1, latent]
        k_pe = self._append(self.values, layer_id, v)  # [L, 1, rope]
        keys = torch.cat((c_kv, k_pe), dim=-1)
        mask = causal_mask(q.shape[0], keys.shape[0], 0, q.device)
        mask = keep if mask is None else keep & mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [num_heads, T, latent + rope]
            keys.transpose(0, 1).to(q.dtype),
            c_kv.transpose(0, 1).to(q.dtype),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [T, num_heads, latent]
