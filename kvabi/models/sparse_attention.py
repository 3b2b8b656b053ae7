"""The attention seam of DeepSeek V3.2's sparse attention: an `AttentionFn` that also keeps
each layer's indexer keys (the sidecar plane `indexer`) and limits each query to the keys the
indexer picks among them.

The model hands the attention an `IndexerQuery` (the new tokens' indexer keys, the indexer's
queries and head weights, and its selection rule); the attention caches the keys beside the
latents, then, per sequence, applies the rule to that sequence's cached keys: so a batch of
sequences (the paged engine's) is scored per sequence, as one sequence is.
`ContiguousSparseAttention` is its plain reference: `ContiguousAttention` plus a per-layer
tensor of indexer keys (HF's `cache.update_indexer`, unquantised), and MLA attention limited
to the keys the indexer picked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvabi.abi.descriptor import MLA
from kvabi.models.attention import ContiguousAttention, causal_mask
from kvabi.models.errors import CheckpointError

# (queries [n, H, D], head weights [n, H], cached keys [L, D]) -> keep [n, L] bool: the last n
# of L positions' picks (within causality)
Selection = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class IndexerQuery:
    """One layer's lightning indexer over a step's T new tokens (all sequences', flat)."""

    keys: torch.Tensor  # [T, index_head_dim] their indexer keys (post-RoPE), to be cached
    queries: torch.Tensor  # [T, index_n_heads, index_head_dim] (post-RoPE)
    weights: torch.Tensor  # [T, index_n_heads] float32 head weights
    select: Selection

    def keep(self, rows: slice, cached: torch.Tensor) -> torch.Tensor:
        """Bool [n, L]: the keys the queries `rows` (the last n of a sequence's L positions)
        may attend, given that sequence's cached keys [L, index_head_dim]."""
        return self.select(self.queries[rows], self.weights[rows], cached)


class SparseAttentionFn(Protocol):
    keeps_indexer: bool  # True: it caches `index.keys` and applies `index.keep`

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        index: IndexerQuery | None = None,
    ) -> torch.Tensor:
        """As `AttentionFn`; with `index`, first cache its keys for layer `layer_id`, then limit
        each query to the keys `index.keep` marks among its sequence's cached ones."""
        ...


def require_sparse(attn: object) -> None:
    """Refuse an attention that would drop the indexer keys (and the sparsity with them)."""
    if not getattr(attn, "keeps_indexer", False):
        raise CheckpointError(
            f"DeepSeek V3.2 needs an attention that keeps the indexer keys (keeps_indexer), "
            f"e.g. ContiguousSparseAttention; got {type(attn).__name__}"
        )


class ContiguousSparseAttention(ContiguousAttention):
    """One sequence's latents and indexer keys, whole, per layer (`indexer_keys[layer]`
    [L, index_head_dim] is HF's indexer cache of that layer)."""

    keeps_indexer = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.indexer_keys: list[torch.Tensor | None] = [None] * len(self.layers)

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = [None] * len(self.layers)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        index: IndexerQuery | None = None,
    ) -> torch.Tensor:
        if index is None:
            return super().__call__(layer_id, q, k, v)
        if self.layers[layer_id].kind != MLA or k is None or v is None:
            raise ValueError(f"layer {layer_id}: an indexer is for MLA layers with their KV")
        cached = self._append(self.indexer_keys, layer_id, index.keys)  # [L, index_head_dim]
        keep = index.keep(slice(None), cached)
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
