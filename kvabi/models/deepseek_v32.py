"""DeepSeek V3.2 decoder (DeepSeek Sparse Attention), equal to HF `DeepseekV32ForCausalLM`
(transformers 5.24) on its eager / SDPA path.

DeepSeek-V3's absorbed MLA (`deepseek_v3.py`) plus a lightning indexer per layer: each token's
indexer key `k = LayerNorm(wk x)` with non-interleaved RoPE on its first `qk_rope_head_dim`
dims is cached beside the latents (the sidecar plane `indexer`, docs/ABI.md 3.3); a query's
`index_n_heads` heads score every earlier key by `sum_h w_h relu(q_h . k) / sqrt(D)`, with
`w = weights_proj(x) / sqrt(index_n_heads)`, and the MLA attention sees only the top
`index_topk` of them. The index scores are computed with HF's operations in HF's shapes, so
that equal inputs pick the same keys, ties included (torch.topk's order); inputs after layer 0
carry the absorbed attention's float rounding, so a key whose score is within that rounding of
the k-th may be picked differently (tests assert the picks are HF's on their prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3Model, MlaAttention
from kvabi.models.deepseek_v3_config import DeepseekV3Config
from kvabi.models.rope import apply_rope
from kvabi.models.sparse_attention import IndexerQuery, SparseAttentionFn, require_sparse

INDEXER_NORM_EPS = 1e-6  # HF's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)


class Indexer(nn.Module):
    """The lightning indexer: which keys each query's MLA attends to."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        assert config.q_lora_rank is not None  # checked by the config
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the cached indexer keys [T, index_head_dim] (post-RoPE)."""
        k = self.k_norm(self.wk(x))[:, None, :]  # [T, 1, D]
        return self._rope(k, cos, sin)[:, 0]

    def query(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> IndexerQuery:
        """The indexer over tokens x [T, hidden] (q_resid: MLA's [T, q_lora_rank])."""
        num_tokens = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(num_tokens, self.num_heads, -1), cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [T, H]
        return IndexerQuery(self.key(x, cos, sin), q, weights, self.select)

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Bool [T, L], True at the keys query t may attend: its top-k earlier keys (the query
        at position L - T + t). q [T, H, D], weights [T, H], keys: a sequence's cached indexer
        keys [L, D], these queries' tokens' last."""
        num_tokens, num_keys = q.shape[0], keys.shape[0]
        # [1, T, H, D] @ [1, 1, D, L], as HF (batch 1), so that equal inputs round alike
        scores = torch.matmul(q[None].float(), keys[None].transpose(-1, -2).float()[:, None])
        scores = F.relu(scores * self.head_dim**-0.5)  # [1, T, H, L]
        index = torch.matmul(weights[None, :, None, :], scores).squeeze(-2)  # [1, T, L]
        query_pos = torch.arange(num_keys - num_tokens, num_keys)[:, None]
        causal = torch.arange(num_keys)[None, :] <= query_pos  # [T, L]
        index = index.masked_fill(~causal, float("-inf"))
        picked = index.topk(min(self.topk, num_keys), dim=-1).indices[0]  # [T, k]
        keep = torch.zeros(num_tokens, num_keys, dtype=torch.bool).scatter_(1, picked, True)
        return keep & causal

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Non-interleaved (rotate_half) RoPE on the first rope_dim dims, unlike MLA's."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)


class SparseMlaAttention(MlaAttention):
    def __init__(self, config: DeepseekV3Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.indexer = Indexer(config)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: SparseAttentionFn
    ) -> torch.Tensor:
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
        index = self.indexer.query(x, q_resid, cos, sin)
        return self.attend(x, self.q_b_proj(q_resid), cos, sin, attn, index=index)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    def __init__(self, config: DeepseekV3Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.self_attn = SparseMlaAttention(config, layer_id)


class DeepseekV32Model(DeepseekV3Model):
    """As `DeepseekV3Model`; `attn` must also keep the indexer keys (`SparseAttentionFn`:
    `ContiguousSparseAttention`, or the engine's `PagedAttention` over a cache with the
    indexer plane): a plain `AttentionFn` is refused."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(
            DeepseekV32DecoderLayer(config, i) for i in range(config.num_layers)
        )

    def hidden_states(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: SparseAttentionFn
    ) -> torch.Tensor:
        require_sparse(attn)
        return super().hidden_states(input_ids, positions, attn)
