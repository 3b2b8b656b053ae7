"""Which attention path a layer gets: the engine's dispatch predicates, named.

`PagedAttention` asks these before each fast kernel call and runs the torch path (SDPA over
gathered K/V) when one answers with a reason; `kvabi plan` asks the same ones with the
tensors the engine would pass, to report each KV group's path on this machine. Each returns
None where the native kernel runs, else why it does not (a short phrase).
"""

from __future__ import annotations

import torch

from kvabi.cache.kv_storage import KVStorage
from kvabi.native.cpu_kernels import CpuKernels, kernel_status

MLA_PREFILL = "MLA prefill: no native kernel"
SPARSE_MLA = "DeepSeek V3.2 indexer: top-k sparse attention (engine/sparse_mla.py)"
COMPRESSED = "DeepSeek V4: window + entries with sinks, per sequence (engine/compressed_paged.py)"


def no_kernels() -> str:
    """The reason when the native kernels are not in use (not built, disabled, or another
    backend asked for)."""
    return f"no native kernels ({kernel_status()})"


def decode_gap(
    kernels: CpuKernels | None,
    window: int,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
) -> str | None:
    """Why a step's decodes of a K/V layer (q [S, H, D] over the pool views) do not go to
    `kvabi_paged_decode`, or None."""
    if kernels is None:
        return no_kernels()
    if window:
        return f"sliding window {window} (the kernel reads the whole context)"
    return kernels.paged_decode_gap(q, k_pool, v_pool)


def prefill_gap(
    kernels: CpuKernels | None,
    window: int,
    has_new_kv: bool,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
) -> str | None:
    """Why a prefill chunk of a K/V layer does not go to `kvabi_prefill_attention`, or None;
    the chunk's tensors then still pass `CpuKernels.prefill_gap` (checked before the gather,
    so an unsupported chunk is not gathered twice)."""
    if kernels is None:
        return no_kernels()
    if not has_new_kv:
        return "shared layer (reads another layer's K/V)"
    if window:
        return f"sliding window {window} (the kernel is causal over the whole context)"
    if kernels.gemm is None:
        return "neither AMX nor AVX512-BF16"
    if not q_dtype == kv_dtype == torch.bfloat16:
        return "not bf16"
    if head_dim % 32:
        return f"head_dim {head_dim} not a multiple of 32"
    return None


def mla_decode_gap(
    kernels: CpuKernels | None, storage: KVStorage, slot: int, q: torch.Tensor
) -> str | None:
    """Why a step's decodes of an MLA layer (q [S, H, latent + rope], absorbed) do not go to
    `kvabi_mla_decode_records`, or None."""
    if kernels is None:
        return no_kernels()
    if not storage.is_records:
        layout = storage.desc.layout.name or "this layout"
        return f"{layout}: the kernel reads fp8_ds_mla records only"
    return kernels.mla_records_gap(q, storage.joint[slot])
