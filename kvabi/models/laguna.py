"""Laguna (poolside) decoder in plain PyTorch, equal to HF `LagunaForCausalLM` (transformers 5.24).

Per layer: q/k RMSNorm, partial RoPE per layer type, the layer's own number of query heads over
a fixed KV geometry, a softplus output gate on the attention output (one per head, or one per
channel), then a SwiGLU MLP (`dense`) or a sigmoid-routed MoE plus a shared expert (`sparse`).
Parameter names equal HF's without the `model.` prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.decoder import TypedLayerDecoder
from kvabi.models.experts import Experts, SiluMLP
from kvabi.models.laguna_config import FULL, SLIDING, LagunaConfig
from kvabi.models.layer_rope import apply_partial_rope, partial_inv_freq
from kvabi.models.llama import RMSNorm
from kvabi.models.rope import FrequencyRope


class LagunaAttention(nn.Module):
    def __init__(self, config: LagunaConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads_per_layer[layer_id]
        self.head_dim = head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = self.num_heads * head_dim, config.num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.per_head_gate = config.gating == "per-head"
        self.g_proj = nn.Linear(
            hidden, self.num_heads if self.per_head_gate else q_size, bias=False
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, -1, self.head_dim))
        v = self.v_proj(x).view(num_tokens, -1, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        out = attn(self.layer_id, q, k, v)  # [num_tokens, num_heads, head_dim]
        gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
        # per head: gate [T, num_heads] scales each head; per element: [T, num_heads * head_dim]
        out = out * gate[:, :, None] if self.per_head_gate else out.reshape(num_tokens, -1) * gate
        return self.o_proj(out.reshape(num_tokens, -1))


class LagunaRouter(nn.Module):
    """Sigmoid scores (of optionally tanh-capped logits); the top k of score + a learned
    per-expert bias are chosen, weighted by their scores renormalised to sum to 1."""

    def __init__(self, config: LagunaConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.softcap = config.moe_router_logit_softcapping
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (top_k_index, top_k_weights), each [T, top_k]."""
        logits = F.linear(x, self.weight).float()  # [T, num_experts]
        if self.softcap > 0.0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        biased = scores + self.e_score_correction_bias.to(scores.dtype)
        _, index = torch.topk(biased, self.top_k, dim=-1)
        weights = scores.gather(-1, index)
        return index, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


class LagunaSparseMoe(nn.Module):
    def __init__(self, config: LagunaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size, F.silu)
        self.gate = LagunaRouter(config)
        self.shared_experts = SiluMLP(hidden, config.shared_expert_intermediate_size)
        self.routed_scaling_factor = config.moe_routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        routed = self.experts(x, *self.gate(x))
        return routed * self.routed_scaling_factor + shared


class LagunaDecoderLayer(nn.Module):
    def __init__(self, config: LagunaConfig, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LagunaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        sparse = config.mlp_layer_types[layer_id] == "sparse"
        self.mlp = LagunaSparseMoe(config) if sparse else SiluMLP(hidden, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LagunaModel(TypedLayerDecoder):
    """`forward(input_ids, positions, attn) -> logits [num_tokens, vocab_size]`, as `LlamaModel`."""

    def __init__(self, config: LagunaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LagunaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {kind: self._rotary(kind) for kind in (SLIDING, FULL) if kind in config.layer_types}
        )
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _rotary(self, layer_type: str) -> FrequencyRope:
        rope = self.config.layer_rope(self.config.layer_types.index(layer_type))
        return FrequencyRope(
            partial_inv_freq(self.config.head_dim, rope.theta, rope.partial_rotary_factor)
        )
