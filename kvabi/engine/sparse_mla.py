"""DeepSeek V3.2's sparse MLA over the paged cache: each query attends only to the latents its
lightning indexer picks among its sequence's cached indexer keys (the sidecar plane).

The selection is the model's (`IndexerQuery.keep`, HF's arithmetic); the cache's part is the
keys it scores: those stored in the pool, fp8 with a scale per token as vLLM stores them, read
back dequantised. Sequences are scored one at a time, as a batch of one (HF's shapes), so a
batch picks what each sequence alone would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvabi.models.sparse_attention import IndexerQuery

if TYPE_CHECKING:
    from kvabi.engine.paged_attention import LayerKV, StepContext


def attend_sparse_mla(
    kv: LayerKV, layer_id: int, q: torch.Tensor, ctx: StepContext, index: IndexerQuery
) -> torch.Tensor:
    """Absorbed MLA, q [T, H, latent + rope] -> [T, H, latent], each query limited to the keys
    `index.keep` marks (within causality) among its sequence's cached indexer keys."""
    if ctx.window:
        raise ValueError(f"layer {layer_id}: sparse MLA has no sliding window")
    latent = kv.spec(layer_id).latent_dim
    out = q.new_empty((*q.shape[:-1], latent))
    for s in ctx.seqs:
        rows = slice(s.query_start, s.query_start + s.num_queries)
        keep = index.keep(rows, kv.indexer_keys(layer_id, s))  # [n, L] bool
        keys = kv.mla_keys(layer_id, s.block_table, q.dtype).flatten(0, 1)
        keys = keys[: s.context_len, 0]  # [L, latent + rope]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], keys[None, None], keys[None, None, :, :latent],
            attn_mask=keep, enable_gqa=True,
        )  # fmt: skip
        out[rows] = o[0].transpose(0, 1)
    return out
