"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, GQA, SwiGLU, optional biases.

It covers Llama 2/3 (incl. Llama-3 RoPE scaling), SmolLM2, Mistral and Qwen2 (QKV bias). Inputs
are flat: `num_tokens` tokens of one or many sequences with their positions; attention is handed
per layer to an `AttentionFn`, so the model holds no cache and knows nothing of sequences.
Parameter names equal HF's without the `model.` prefix (`layers.0.self_attn.q_proj.weight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.config import ModelConfig
from kvabi.models.decoder import Decoder
from kvabi.models.packed_linear import PackedLinear
from kvabi.models.rope import RotaryEmbedding, apply_rope
from kvabi.native.cpu_kernels import CpuKernels

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a partial output -> the ranks' sum


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as HF does.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_out_bias)
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv: PackedLinear | None = None  # set by fuse(): q, k and v in one GEMM
        self.out: PackedLinear | None = None
        self.kernels: CpuKernels | None = None  # set by LlamaModel.use_kernels
        self.reduce: Reduce | None = None  # tensor parallelism: sums the ranks' outputs

    def fuse(self, pack: bool, kernels: CpuKernels | None = None) -> None:
        if self.qkv is None:
            qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            self.qkv = PackedLinear(*qkv, pack, kernels)
            self.out = PackedLinear(self.o_proj.weight, self.o_proj.bias, pack, kernels)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv is not None and self.kernels is not None:
            qkv = self.qkv(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
            rotated = qkv[:, : self.sizes[0] + self.sizes[1]]  # q and k: one in-place pass
            self.kernels.rope_(rotated.view(num_tokens, -1, self.head_dim), cos, sin)
            q, k, v = qkv.split(self.sizes, dim=-1)
        elif self.qkv is not None:  # one GEMM instead of three
            q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kernels is None or self.qkv is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_id, q, k, v)  # [num_tokens, num_heads, head_dim]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        out = self.o_proj(out) if self.out is None else self.out(out)
        return out if self.reduce is None else self.reduce(out)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up: PackedLinear | None = None  # set by fuse(): gate and up in one GEMM
        self.down: PackedLinear | None = None
        self.kernels: CpuKernels | None = None  # set by LlamaModel.use_kernels
        self.reduce: Reduce | None = None  # tensor parallelism: sums the ranks' outputs

    def fuse(self, pack: bool, kernels: CpuKernels | None = None) -> None:
        if self.gate_up is None:
            gate_up = fuse_linears([self.gate_proj, self.up_proj])
            self.gate_up = PackedLinear(*gate_up, pack, kernels)
            self.down = PackedLinear(self.down_proj.weight, self.down_proj.bias, pack, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return out if self.reduce is None else self.reduce(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or self.down is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kernels is not None:
            return self.down(self.kernels.silu_and_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears sharing an input, and make each linear's
    parameters views into the result: one GEMM for all, no second copy of the weights."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        self.kernels: CpuKernels | None = None  # set by LlamaModel.use_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        if self.kernels is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
            return x + self.mlp(self.post_attention_layernorm(x))
        # Fused: the residual stream x is updated in place (it is this forward's own tensor).
        norm1, norm2, k = self.input_layernorm, self.post_attention_layernorm, self.kernels
        h = k.rms_norm(x, norm1.weight, norm1.eps)
        h = k.rms_norm(self.self_attn(h, cos, sin, attn), norm2.weight, norm2.eps, residual=x)
        return x.add_(self.mlp(h))


class LlamaModel(Decoder):
    """`forward(input_ids, positions, attn) -> logits [num_tokens, vocab_size]`.

    Engines that need logits only for some tokens call `hidden_states` then `compute_logits` on
    the rows they want. With tied embeddings there is no `lm_head` parameter.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits: PackedLinear | None = None  # set by fuse_projections(pack=True)

    def fuse_projections(self, pack: bool = True, kernels: CpuKernels | None = None) -> LlamaModel:
        """Serve q/k/v and gate/up with one GEMM each (weights shared, outputs unchanged up to
        GEMM summation order). Parameters stay HF-named views, so state_dict() still works.
        `pack`: also keep each GEMM's weight pre-packed for a CPU GEMM (see `PackedLinear`;
        one more copy of the weights in memory); with `kernels`, kvabi's AMX GEMM where it runs.
        It fuses once per model (`LoadedModel` does it when the model is loaded)."""

        for layer in self.layers:
            layer.self_attn.fuse(pack, kernels)
            layer.mlp.fuse(pack, kernels)
        if self.logits is None:
            self.logits = PackedLinear(self.logit_weight, None, pack, kernels)
        return self

    def use_kernels(self, kernels: CpuKernels | None) -> LlamaModel:
        """Run RMSNorm (+ residual add), RoPE and SiLU-and-mul through the fused CPU kernels
        (None: the plain torch ops). RoPE and SiLU are fused only once projections are fused."""
        for layer in self.layers:
            layer.kernels = layer.self_attn.kernels = layer.mlp.kernels = kernels
        return self

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, layer_ids: range
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)  # [num_tokens, head_dim] each
        for i in layer_ids:
            x = self.layers[i](x, cos, sin, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits is not None:
            return self.logits(hidden)  # [num_tokens, vocab_size]
        return super().compute_logits(hidden)
