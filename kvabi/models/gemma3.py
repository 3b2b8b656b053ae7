"""Gemma 3 text decoder in plain PyTorch, equal to HF `Gemma3ForCausalLM` (transformers 5.24).

Per layer: q/k RMSNorm, attention scale `query_pre_attn_scalar ** -0.5` (folded into q: the
attention callee divides by sqrt(head_dim)), four sandwich norms and a gelu-tanh MLP. Norm
weights are offsets: HF multiplies by (1 + weight). Sliding and full layers share one geometry
and differ in window and RoPE theta. Parameter names equal HF's without the `model.` prefix.
"""

from __future__ import annotations

import math
from typing import Self

import torch
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.decoder import TypedLayerDecoder
from kvabi.models.gemma3_config import FULL, SLIDING, Gemma3Config
from kvabi.models.gemma4 import Gemma4MLP, ScaledEmbedding
from kvabi.models.rope import FrequencyRope, apply_rope, scaled_inv_freq
from kvabi.native.cpu_kernels import CpuKernels


class Gemma3RMSNorm(nn.Module):
    """HF's Gemma3RMSNorm op for op: float32, rsqrt, times (1 + weight) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim = config.head_dim
        # HF scales scores by query_pre_attn_scalar ** -0.5; the callee applies 1/sqrt(head_dim)
        self.q_scale = math.sqrt(head_dim) * config.query_pre_attn_scalar**-0.5
        hidden, eps = config.hidden_size, config.rms_norm_eps
        kv_size = config.num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, config.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(config.num_heads * head_dim, hidden, bias=False)
        self.q_norm = Gemma3RMSNorm(head_dim, eps)
        self.k_norm = Gemma3RMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, -1, self.head_dim))
        v = self.v_proj(x).view(num_tokens, -1, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        q = apply_rope(q, cos, sin)  # [num_tokens, num_heads, head_dim]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = attn(self.layer_id, q, apply_rope(k, cos, sin), v)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = Gemma4MLP(hidden, config.intermediate_size)  # the same gelu-tanh gated MLP
        self.input_layernorm = Gemma3RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(TypedLayerDecoder):
    """`forward(input_ids, positions, attn) -> logits [num_tokens, vocab_size]`, as `LlamaModel`.

    With tied embeddings (Gemma's default) there is no `lm_head` parameter.
    """

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.logit_softcap = config.final_logit_softcapping
        hidden = config.hidden_size
        self.embed_tokens = ScaledEmbedding(config.vocab_size, hidden, hidden**0.5)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Gemma3RMSNorm(hidden, config.rms_norm_eps)
        thetas = {SLIDING: (config.rope_local_base_freq, None),
                  FULL: (config.rope_theta, config.rope_scaling)}  # fmt: skip
        self.rotary = nn.ModuleDict(
            {
                kind: FrequencyRope(scaled_inv_freq(config.head_dim, *thetas[kind]))
                for kind in (SLIDING, FULL)
                if kind in config.layer_types
            }
        )
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)

    def fuse_projections(self, pack: bool = True, kernels: CpuKernels | None = None) -> Self:
        """In bf16 the GEMMs run on packed weights (`pack_linears`); nothing is fused."""
        if pack:
            self.pack_linears(kernels)
        return self
