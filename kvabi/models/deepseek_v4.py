"""DeepSeek V4 decoder in plain PyTorch, equal to HF `DeepseekV4ForCausalLM` (transformers
5.24, its eager path) in float32; parameter names are HF's without `model.`.

Per layer (kvabi/models/deepseek_v4_config.py): hyper-connections collapse the residual
streams into the attention's input; the attention's low-rank query is RMS-normed per head, its
one K=V head is normed, both rotated (the trailing rope dims), and its output is rotated back
(-angle) before the grouped output projection; the cache owner (`CompressedAttentionFn`,
kvabi/models/compressed_attention.py) attends over the window, the compressed entries and the
sinks. The MLP is an MoE whose first layers route by token id (`hash_moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.compressed_attention import CompressedAttentionFn, IndexQuery, Series, V4Query
from kvabi.models.decoder import Decoder
from kvabi.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from kvabi.models.errors import CheckpointError
from kvabi.models.experts import Experts, SiluMLP
from kvabi.models.hyper_connection import (
    HyperConnection,
    HyperHead,
    mix_streams,
    unweighted_rms_norm,
)
from kvabi.models.v4_compressor import Compressor, Indexer
from kvabi.models.v4_rope import V4RMSNorm, V4Rope, apply_v4_rope

Tables = dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin


class GroupedLinear(nn.Linear):
    """HF's `DeepseekV4GroupedLinear`: `groups` block-diagonal projections [T, g, in] -> [T, g,
    out / g], one batched GEMM."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [g, in, out / g]
        y = torch.bmm(x.transpose(0, 1), w)  # [g, T, out / g]
        return y.transpose(0, 1)


def _compressor(config: DeepseekV4Config, layer_id: int) -> Compressor | None:
    """HF's `self_attn.compressor` (None on a sliding layer), with an `indexer` on CSA."""
    kind, ratio = config.layer_types[layer_id], config.compress_rate(layer_id)
    if kind == SLIDING:
        return None
    h, eps = config.hidden_size, config.rms_norm_eps
    compressor = Compressor(h, config.head_dim, ratio, overlap=kind == CSA, eps=eps)
    if kind == CSA:
        compressor.indexer = Indexer(
            h, config.q_lora_rank, config.index_n_heads, config.index_head_dim, ratio,
            config.index_topk, eps,
        )  # fmt: skip
    return compressor


class V4Attention(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id, self.config = layer_id, config
        h, d, heads = config.hidden_size, config.head_dim, config.num_heads
        eps = config.rms_norm_eps
        self.table = "main" if config.layer_types[layer_id] == SLIDING else "compress"
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * d, bias=False)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = V4RMSNorm(d, eps)
        groups = config.o_groups
        self.o_a_proj = GroupedLinear(heads * d // groups, groups * config.o_lora_rank, groups)
        self.o_b_proj = nn.Linear(groups * config.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.compressor = _compressor(config, layer_id)

    def forward(
        self, x: torch.Tensor, tables: Tables, positions: torch.Tensor, rope: V4Rope,
        attn: CompressedAttentionFn,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] -> [T, hidden]."""
        cos, sin = tables[self.table]
        num_tokens, eps = x.shape[0], self.config.rms_norm_eps
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, q_lora_rank]
        q = self.q_b_proj(q_resid).view(num_tokens, self.config.num_heads, -1)
        q = apply_v4_rope(unweighted_rms_norm(q, eps), cos[:, None], sin[:, None])
        kv = self.kv_norm(self.kv_proj(x)).view(num_tokens, 1, -1)
        kv = apply_v4_rope(kv, cos[:, None], sin[:, None])  # [T, 1, head_dim]: K and V
        out = attn(self.layer_id, q, kv, self._query(x, q_resid, tables, rope))
        out = apply_v4_rope(out, cos[:, None], -sin[:, None])  # undo V's rotation
        grouped = out.reshape(num_tokens, self.config.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(1))

    def _query(
        self, x: torch.Tensor, q_resid: torch.Tensor, tables: Tables, rope: V4Rope
    ) -> V4Query:
        c = self.compressor
        if c is None:
            return V4Query(self.sinks, self.config.softmax_scale)
        entries = Series(*c.rows(x), lambda state, kv, gate: c.emit(state, kv, gate, rope))
        index = None
        if hasattr(c, "indexer"):
            i = c.indexer
            series = Series(*i.rows(x), lambda state, kv, gate: i.emit(state, kv, gate, rope))
            index = IndexQuery(series, *i.queries(x, q_resid, *tables["compress"]), i.select)
        return V4Query(self.sinks, self.config.softmax_scale, c.ratio, entries, index)


class V4Router(nn.Module):
    """Top-k by `score + e_score_correction_bias` (`moe`), or the experts `tid2eid` names per
    token id (`hash_moe`); weights are the picked scores, normalised, times the scaling."""

    def __init__(self, config: DeepseekV4Config, by_hash: bool) -> None:
        super().__init__()
        self.config, self.by_hash = config, by_hash
        experts, k = config.n_routed_experts, config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        if by_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        scores = torch.sigmoid(logits)
        if self.config.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        if self.by_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            indices = torch.topk(biased, self.config.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * self.config.routed_scaling_factor


class V4MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        h, inner, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = V4Router(config, config.mlp_layer_types[layer_id] == "hash_moe")
        self.experts = Experts(config.n_routed_experts, h, inner, F.silu, limit)
        self.shared_experts = SiluMLP(h, inner, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x, input_ids)) + self.shared_experts(x)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        hc = (config.hc_mult, h, config.hc_sinkhorn_iters, config.hc_eps, eps)
        self.self_attn = V4Attention(config, layer_id)
        self.mlp = V4MoE(config, layer_id)
        self.input_layernorm = V4RMSNorm(h, eps)
        self.post_attention_layernorm = V4RMSNorm(h, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self, streams: torch.Tensor, tables: Tables, positions: torch.Tensor,
        input_ids: torch.Tensor, rope: V4Rope, attn: CompressedAttentionFn,
    ) -> torch.Tensor:  # fmt: skip
        """streams [T, hc_mult, hidden] -> the same after attention and MLP."""
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), tables, positions, rope, attn)
        streams = mix_streams(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), input_ids)
        return mix_streams(streams, out, post, comb)


class DeepseekV4Model(Decoder):
    """`forward(input_ids, positions, attn) -> logits`; `attn` must keep the compressed entries
    (`CompressedAttentionFn`)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        layers = (DeepseekV4DecoderLayer(config, i) for i in range(config.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = V4RMSNorm(h, eps)
        self.hc_head = HyperHead(config.hc_mult, h, config.hc_eps, eps)
        dim = config.qk_rope_head_dim
        self.rope_main = V4Rope(dim, config.rope_theta)
        self.rope_compress = V4Rope(dim, config.compress_rope_theta, config.compress_rope_scaling)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(h, config.vocab_size, bias=False)

    def hidden_states(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: CompressedAttentionFn
    ) -> torch.Tensor:
        if not getattr(attn, "keeps_compressed", False):
            raise CheckpointError(
                "DeepSeek V4 needs an attention that keeps its compressed entries "
                f"(keeps_compressed), e.g. ContiguousCompressedAttention; got {type(attn).__name__}"
            )
        x = self.embed_tokens(input_ids)  # [T, hidden]
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        tables = {
            "main": self.rope_main(positions, x.dtype),
            "compress": self.rope_compress(positions, x.dtype),
        }
        for layer in self.layers:
            streams = layer(streams, tables, positions, input_ids, self.rope_compress, attn)
        return self.norm(self.hc_head(streams))
