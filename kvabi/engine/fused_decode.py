"""`FusedDecode`: a decode-only step's layers in one C++ call (bf16 on a CPU with AMX or
AVX512-BF16).

The per-layer forward (`LlamaModel.hidden_states` with the C++ kernels and packed GEMMs) calls
about a dozen ops per layer from Python; at decode sizes each op's work is tens of microseconds,
so their dispatch cost about as much as the GEMMs. Here the embedding, RoPE tables and final norm
stay in torch and the layers run in `kvabi_decode_layers` (kvabi/native/cpu_kernels.cpp): the
same ops in the same order with the same kernels, so its output equals the per-layer path's bit
for bit (tests/engine/test_fused_decode.py).

It applies where every piece it needs is there: bf16 weights packed for the packed GEMM, a bf16 KV
pool whose K and V views share strides, and steps with no prefill and no per-layer callback
(`FusedDecode.build` returns None otherwise, and the runner keeps the per-layer path).
"""

from __future__ import annotations

import torch

from kvabi.cache.kv_storage import KVStorage
from kvabi.engine.attention_path import no_kernels
from kvabi.engine.paged_attention import StepContext
from kvabi.models.llama import LlamaModel
from kvabi.models.packed_linear import PackedLinear
from kvabi.native.cpu_kernels import CpuKernels, DecodeLayer, DecodeShape


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    def __init__(self, model: LlamaModel, storage: KVStorage, kernels: CpuKernels) -> None:
        self.model, self.storage, self.kernels = model, storage, kernels
        cfg = model.config
        k0 = storage.k[0]
        self.shape = DecodeShape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, *k0.stride()[:3], k0.shape[1],
            model.layers[0].input_layernorm.eps,
        )  # fmt: skip
        self._keep: list[torch.Tensor] = []  # contiguous copies the pointers refer to
        self.layers = (DecodeLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [
                self._contiguous(n.weight)
                for n in (layer.input_layernorm, layer.post_attention_layernorm)
            ]
            gemms = [(g.tiles, g.bias) for g in (attn.qkv, attn.out, mlp.gate_up, mlp.down)]
            self.layers[i] = DecodeLayer(
                *map(_ptr, norms), *(_ptr(t) for pair in gemms for t in pair),
                storage.k[i].data_ptr(), storage.v[i].data_ptr(),
            )  # fmt: skip
        # KVStorage allocates its pools once and only writes into them, so these pointers stay
        # valid for the engine's life; the weights live in the model's PackedLinears.

    def _contiguous(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        self._keep.append(t)
        return t

    @classmethod
    def build(
        cls, model: LlamaModel, storage: KVStorage, kernels: CpuKernels | None
    ) -> FusedDecode | None:
        """A FusedDecode where everything it needs is there, else None (see the module doc)."""
        if kernels is None or cls.gap(model, storage, kernels) is not None:
            return None
        return cls(model, storage, kernels)

    @staticmethod
    def kernel_gap(kernels: CpuKernels | None, dtype: torch.dtype) -> str | None:
        """Why no model in `dtype` gets a FusedDecode here (before its weights are looked at),
        or None."""
        if kernels is None:
            return no_kernels()
        if kernels.gemm is None:
            return "no packed GEMM (the CPU has neither AMX nor AVX512-BF16)"
        return None if dtype == torch.bfloat16 else "not bf16"

    @staticmethod
    def gap(model: LlamaModel, storage: KVStorage, kernels: CpuKernels | None) -> str | None:
        """Why `build` gives this model and storage no FusedDecode, or None."""
        if not isinstance(model, LlamaModel):
            return "not a Llama-family model"
        if (why := FusedDecode.kernel_gap(kernels, model.dtype)) is not None:
            return why
        eps = {n.eps for layer in model.layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm)}  # fmt: skip
        if len(eps) != 1:
            return "norms of several eps"
        gemms: list[PackedLinear | None] = [
            g for layer in model.layers
            for g in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)
        ]  # fmt: skip
        if any(g is None or g.tiles is None for g in gemms):
            return "weights not packed for the packed GEMM"
        cfg = model.config  # the sizes kvabi_decode_layers takes (it checks them again)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = (cfg.hidden_size, q_size, cfg.intermediate_size)
        if any(n % 32 for n in sizes) or kv_size % 16 or cfg.num_heads % cfg.num_kv_heads:
            return "sizes not multiples of 32"
        strides = {t.stride() for t in storage.k + storage.v}
        pools_ok = all(t.dtype == torch.bfloat16 for t in storage.k + storage.v)
        if len(strides) != 1 or not pools_ok or storage.k[0].stride(-1) != 1:
            return "KV pools not bf16 of one stride"
        return None

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """As `model.hidden_states` for a step whose every row is one sequence's decode token
        (`ctx.prefills` empty; rows in `ctx.seqs` order). Writes the step's K/V to the pool."""
        x = self.model.embed_tokens(input_ids).contiguous()
        cos, sin = self.model.rotary(positions, x.dtype)
        self.kernels.decode_layers(
            self.layers, self.shape, x, cos, sin, ctx.slot_blocks, ctx.slot_offsets,
            ctx.decode_tables, ctx.decode_lens,
        )  # fmt: skip
        return self.model.norm(x)
