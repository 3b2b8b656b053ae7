"""DeepSeek-V3 decoder in plain PyTorch, equal to HF `DeepseekV3ForCausalLM` (transformers 5.24).

Attention is MLA, run absorbed: each token caches only its latent c_kv (`kv_a_layernorm` of the
first `kv_lora_rank` outputs of `kv_a_proj_with_mqa`) and one RoPE key k_pe shared by all heads.
`kv_b_proj` holds, per head, W_UK [qk_nope_head_dim, kv_lora_rank] and W_UV [v_head_dim,
kv_lora_rank]; the query's no-RoPE part goes through W_UK into latent space, so the
`AttentionFn` scores q . [c_kv | k_pe] and returns a latent per head, which W_UV lifts to the
value space before `o_proj`. This is HF's attention with the matrix products reassociated, so
logits agree to float32 rounding, not to the bit. MoE layers route by sigmoid scores plus a
bias, top-k within the best `topk_group` of `n_group` expert groups. Parameter names equal HF's
without the `model.` prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.decoder import Decoder
from kvabi.models.deepseek_v3_config import DeepseekV3Config
from kvabi.models.experts import Experts, SiluMLP
from kvabi.models.llama import RMSNorm
from kvabi.models.rope import FrequencyRope, apply_rope, default_inv_freq

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm keep the default, not rms_norm_eps


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the result is laid
    out de-interleaved (all first elements, then all second), as HF returns it. x [T, heads, d];
    cos/sin [T, d] (`cat(freqs, freqs)`: the first half holds each pair's angle)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MlaAttention(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = heads = config.num_heads
        self.split_q = [config.qk_nope_head_dim, config.qk_rope_head_dim]
        self.split_kv = [config.kv_lora_rank, config.qk_rope_head_dim]
        self.split_b = [config.qk_nope_head_dim, config.v_head_dim]
        self.interleave = config.rope_interleave
        hidden, bias, rank = config.hidden_size, config.attention_bias, config.q_lora_rank
        q_size = heads * config.qk_head_dim
        if rank is None:
            self.q_proj = nn.Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, rank, bias=bias)
            self.q_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, sum(self.split_kv), bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * sum(self.split_b), bias=False)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=bias)
        # the callee divides by sqrt(kv_lora_rank + rope); the model's scale is softmax_scale
        self.q_scale = config.softmax_scale * math.sqrt(sum(self.split_kv))
        self.has_q_lora = rank is not None

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_q_lora:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_interleaved_rope(x, cos, sin) if self.interleave else apply_rope(x, cos, sin)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [heads, nope, latent], W_UV [heads, v_dim, latent]."""
        w = self.kv_b_proj.weight.view(self.num_heads, sum(self.split_b), -1)
        w_uk, w_uv = w.split(self.split_b, dim=1)
        return w_uk, w_uv

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        return self.attend(x, self._query(x), cos, sin, attn)

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionFn,
        **attn_kwargs: object,
    ) -> torch.Tensor:
        """MLA over query projections q [T, heads * qk_head_dim]; `attn_kwargs` go to `attn`
        (DeepSeek V3.2's `index`, an `IndexerQuery`)."""
        num_tokens = x.shape[0]
        q = q.view(num_tokens, self.num_heads, -1)  # [T, heads, qk_head_dim]
        q_nope, q_pe = q.split(self.split_q, dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(self.split_kv, dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)[:, None, :]  # [T, 1, kv_lora_rank]
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe[:, None, :], cos, sin)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, heads, kv_lora_rank]
        q = torch.cat((q_latent, q_pe), dim=-1) * self.q_scale
        out = attn(self.layer_id, q, c_kv, k_pe, **attn_kwargs)  # [T, heads, kv_lora_rank]
        out = torch.einsum("thl,hvl->thv", out, w_uv)  # [T, heads, v_head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


class GroupLimitedRouter(nn.Module):
    """Sigmoid scores in float32; experts are chosen by score + `e_score_correction_bias`, only
    from the `topk_group` groups whose two best biased scores sum highest; they are weighted by
    their unbiased scores (renormalised when `norm_topk_prob`) times `routed_scaling_factor`."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.top_k, self.num_groups = config.num_experts_per_tok, config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (top_k_index, top_k_weights float32), each [T, top_k]."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, num_experts]
        biased = scores + self.e_score_correction_bias.float()
        biased = biased.masked_fill(~self._group_mask(biased), float("-inf"))
        index = torch.topk(biased, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * self.scaling

    def _group_mask(self, biased: torch.Tensor) -> torch.Tensor:
        """[T, num_experts] bool: the expert is in one of the token's `topk_group` best groups."""
        if self.num_groups == 1:
            return torch.ones_like(biased, dtype=torch.bool)
        grouped = biased.view(biased.shape[0], self.num_groups, -1)  # [T, groups, per_group]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return chosen[:, :, None].expand_as(grouped).reshape_as(biased)


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.moe_intermediate_size
        self.experts = Experts(config.n_routed_experts, hidden, inner, F.silu)
        self.gate = GroupLimitedRouter(config)
        self.shared_experts = SiluMLP(hidden, inner * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x)) + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MlaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = (
            DeepseekV3MoE(config)
            if config.is_moe_layer(layer_id)
            else SiluMLP(hidden, config.intermediate_size)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(Decoder):
    """`forward(input_ids, positions, attn) -> logits [num_tokens, vocab_size]`, as `LlamaModel`;
    `attn` gets MLA's latents (see `AttentionFn`)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        yarn, dim, theta = config.rope_scaling, config.qk_rope_head_dim, config.rope_theta
        inv_freq = default_inv_freq(dim, theta) if yarn is None else yarn.inv_freq(dim, theta)
        self.rotary = FrequencyRope(inv_freq)  # [qk_rope_head_dim // 2]
        self.cos_sin_factor = 1.0 if yarn is None else yarn.cos_sin_factor
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, layer_ids: range
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, torch.float32)  # [num_tokens, qk_rope_head_dim]
        cos, sin = (cos * self.cos_sin_factor).to(x.dtype), (sin * self.cos_sin_factor).to(x.dtype)
        for i in layer_ids:
            x = self.layers[i](x, cos, sin, attn)
        return x
