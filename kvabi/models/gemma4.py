"""Gemma 4 text decoder in plain PyTorch, equal to HF `Gemma4ForCausalLM` (transformers 5.24).

Per layer: q/k RMSNorm and a scale-free v norm, attention scale 1 (folded into q: the attention
callee divides by sqrt(head_dim)), four sandwich norms, a gelu-tanh MLP (optionally beside a MoE
block), the per-layer embedding (PLE) residual, and a learned `layer_scalar`. Sliding and full
layers differ in head_dim, KV heads and RoPE. KV-shared layers (`num_kv_shared_layers`) have no
k/v projections and call `attn(layer_id, q, None, None)`. Parameter names equal HF's without
the `model.` (or `model.language_model.`) prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.decoder import Decoder
from kvabi.models.experts import Experts
from kvabi.models.gemma4_config import FULL, SLIDING, Gemma4Config
from kvabi.models.layer_rope import proportional_inv_freq
from kvabi.models.rope import FrequencyRope, apply_rope


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma4RMSNorm(nn.Module):
    """HF's Gemma4RMSNorm op for op: float32, pow(-0.5), weight in float32 (none for v_norm)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim = config.layer_head_dim(layer_id)
        self.q_scale = math.sqrt(head_dim)  # HF's scaling is 1.0; the callee applies 1/sqrt(d)
        self.is_shared = config.kv_source(layer_id) != layer_id
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, config.num_heads * head_dim, bias=False)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        self.k_proj = self.v_proj = self.k_norm = self.v_norm = None
        if not self.is_shared:
            kv_size = config.layer_kv_heads(layer_id) * head_dim
            self.k_proj = nn.Linear(hidden, kv_size, bias=False)
            if not config.has_k_eq_v(layer_id):
                self.v_proj = nn.Linear(hidden, kv_size, bias=False)
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(config.num_heads * head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, -1, self.head_dim))
        q = apply_rope(q, cos, sin) * self.q_scale  # [num_tokens, num_heads, head_dim]
        k = v = None
        if self.k_proj is not None and self.k_norm is not None and self.v_norm is not None:
            raw_k = self.k_proj(x).view(num_tokens, -1, self.head_dim)
            raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(raw_k.shape)
            k = apply_rope(self.k_norm(raw_k), cos, sin)  # [num_tokens, num_kv_heads, head_dim]
            v = self.v_norm(raw_v)  # K = V layers: V is k_proj's output, v-normed, no RoPE
        out = attn(self.layer_id, q, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.down_proj = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Gemma4Router(nn.Module):
    """Softmax top-k over the experts, renormalised, times a learned per-expert scale."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (top_k_index, top_k_weights), each [T, top_k]."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)  # [T, num_experts]
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return index, weights * self.per_expert_scale[index]


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_id)
        wide = config.use_double_wide_mlp and self.self_attn.is_shared
        self.mlp = Gemma4MLP(hidden, config.intermediate_size * (2 if wide else 1))
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer_input_gate = self.per_layer_projection = None
        if config.hidden_size_per_layer_input:
            ple = config.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(hidden, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.router = self.experts = None
        if config.num_experts:
            self.router = Gemma4Router(config)
            self.experts = Experts(
                config.num_experts, hidden, config.moe_intermediate_size, gelu_tanh
            )
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):  # fmt: skip
                setattr(self, name, Gemma4RMSNorm(hidden, eps))

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None and self.experts is not None:
            index, weights = self.router(x)
            moe = self.experts(self.pre_feedforward_layernorm_2(x), index, weights)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None and self.per_layer_projection is not None:
            h = gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class ScaledEmbedding(nn.Embedding):
    """Looks up and multiplies by `scale`, rounded to the weight's dtype through float32 (as HF:
    sqrt(3072) = 55.4256 becomes 55.5 in bf16)."""

    def __init__(self, num_embeddings: int, dim: int, scale: float) -> None:
        super().__init__(num_embeddings, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32, device=ids.device)
        return super().forward(ids) * scale.to(self.weight.dtype)


def rotaries(config: Gemma4Config) -> nn.ModuleDict:
    """One RoPE per layer type the config uses (its head_dim, theta and rotated fraction)."""
    tables = {}
    for layer_type in (SLIDING, FULL):
        if layer_type in config.layer_types:
            first = config.layer_types.index(layer_type)
            rope, head_dim = config.layer_rope(first), config.layer_head_dim(first)
            fraction = rope.partial_rotary_factor if rope.rope_type == "proportional" else 1.0
            inv_freq = proportional_inv_freq(head_dim, rope.theta, fraction, rope.factor)
            tables[layer_type] = FrequencyRope(inv_freq)
    return nn.ModuleDict(tables)


class Gemma4Model(Decoder):
    """`forward(input_ids, positions, attn) -> logits [num_tokens, vocab_size]`, as `LlamaModel`.

    With tied embeddings (Gemma's default) there is no `lm_head` parameter.
    """

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.config = config
        self.logit_softcap = config.final_logit_softcapping
        hidden = config.hidden_size
        self.embed_tokens = ScaledEmbedding(config.vocab_size, hidden, hidden**0.5)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = rotaries(config)
        ple = config.hidden_size_per_layer_input
        if ple:
            total = config.num_layers * ple
            self.embed_tokens_per_layer = ScaledEmbedding(
                config.vocab_size_per_layer_input, total, ple**0.5
            )
            self.per_layer_model_projection = nn.Linear(hidden, total, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(ple, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """PLE: (norm(projection of the embedding) + per-layer token embedding) / sqrt(2),
        [num_tokens, num_layers, hidden_size_per_layer_input]; None without PLE."""
        ple = self.config.hidden_size_per_layer_input
        if not ple:
            return None
        shape = (input_ids.shape[0], self.config.num_layers, ple)
        token_part = self.embed_tokens_per_layer(input_ids).reshape(shape)
        projected = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + token_part) * 2.0**-0.5

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        per_layer = self.per_layer_inputs(input_ids, x)
        tables = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.config.layer_types[i]]
            x = layer(x, None if per_layer is None else per_layer[:, i], cos, sin, attn)
        return self.norm(x)
