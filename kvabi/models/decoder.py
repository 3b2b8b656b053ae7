"""`Decoder`: what every kvabi model shares, whatever its layers.

Built from a complete state dict without random init; `forward` is `compute_logits` over
`hidden_states`; logits go through `lm_head`, or the input embedding when the model ties them
(no `lm_head` parameter then), capped by `logit_softcap` where set (Gemma). Models without fused
or packed paths (Gemma 4, Laguna, DeepSeek) keep the no-op `fuse_projections` / `use_kernels`;
`LlamaModel` overrides them, and Gemma 3 packs its GEMMs in bf16 (`pack_linears`).
`TypedLayerDecoder` runs layers of named types, one RoPE table each.
"""

from __future__ import annotations

from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.attention import AttentionFn
from kvabi.models.packed_linear import PackedLinear
from kvabi.native.cpu_kernels import CpuKernels


class Decoder(nn.Module):
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None
    logit_softcap: float | None = None  # Gemma's final softcapping: tanh(x / cap) * cap
    packed_logits: PackedLinear | None = None  # set by pack_linears

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor]) -> Self:
        """Build without random init; all parameters must be present, dtype/device as given."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state_dict, strict=True, assign=True)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def logit_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: `lm_head`'s, or the tied embedding's."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        return self.norm(self.run_layers(x, positions, attn, range(len(self.layers))))

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, layer_ids: range
    ) -> torch.Tensor:
        """The residual stream [num_tokens, hidden_size] after layers `layer_ids`, from `x`
        before them: a forward in parts (early-exit speculation runs the first layers alone).
        Models whose layers take more than the stream (Gemma 4's per-layer inputs) do not."""
        raise NotImplementedError(f"{type(self).__name__} does not run its layers in parts")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_logits is not None:
            logits = self.packed_logits(hidden)
        else:
            logits = F.linear(hidden, self.logit_weight)  # [num_tokens, vocab_size]
        cap = self.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions, attn))

    def fuse_projections(self, pack: bool = True, kernels: CpuKernels | None = None) -> Self:
        """No fused or packed GEMMs: plain torch throughout."""
        return self

    def pack_linears(self, kernels: CpuKernels | None) -> None:
        """bf16 on the CPU: every `nn.Linear`'s weight, and the logits' (the tied embedding's
        included), packed once for a CPU GEMM (`PackedLinear`: kvabi's AMX or AVX512-BF16 GEMM
        where `kernels` has one, else oneDNN's packing) instead of being reordered by oneDNN on
        every call; a module keeps its parameters (state_dict unchanged) and runs the packed
        GEMM as its forward. One more copy of each weight in memory. Other dtypes: unchanged
        (float32 stays on F.linear, whose results the reference tests compare bit-near)."""
        if self.dtype != torch.bfloat16 or self.embed_tokens.weight.device.type != "cpu":
            return
        for module in self.modules():
            if type(module) is nn.Linear:
                module.forward = PackedLinear(module.weight, module.bias, True, kernels)
        self.packed_logits = PackedLinear(self.logit_weight, None, True, kernels)

    def use_kernels(self, kernels: CpuKernels | None) -> Self:
        """No fused CPU kernels."""
        return self


class TypedLayerDecoder(Decoder):
    """Layers of named types (`config.layer_types`: sliding, full), each type with its own RoPE
    table in `rotary`; embeddings, then the layers, then the final norm (Gemma 3, Laguna)."""

    rotary: nn.ModuleDict
    config: Any

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, layer_ids: range
    ) -> torch.Tensor:
        kinds = {self.config.layer_types[i] for i in layer_ids}
        tables = {kind: self.rotary[kind](positions, x.dtype) for kind in kinds}
        for i in layer_ids:
            x = self.layers[i](x, *tables[self.config.layer_types[i]], attn)
        return x
