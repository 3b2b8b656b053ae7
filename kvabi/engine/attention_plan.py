"""Which attention path each KV group of a model gets on this machine (`kvabi plan`).

The answer comes from the engine's own dispatch predicates (`attention_path.py`) asked with the
tensors the engine would pass them: a two-block `KVCache` in the planned descriptor (the
engine's storage classes, so its pool views, strides and dtypes) and query tensors of the
model's head counts in the engine's compute dtype. A path is the native C++ kernel (and, for
paged decode, which of its loops) or the general torch path with the reason the kernel does
not take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvabi.abi.descriptor import CENTRIES, MLA, Descriptor
from kvabi.abi.kv_groups import KVGroup, kv_groups
from kvabi.cache.block_groups import plan_groups
from kvabi.cache.kv_cache import KVCache
from kvabi.engine.attention_path import (
    COMPRESSED,
    MLA_PREFILL,
    SPARSE_MLA,
    decode_gap,
    mla_decode_gap,
    prefill_gap,
)
from kvabi.engine.fused_decode import FusedDecode
from kvabi.engine.paged_attention import LayerKV
from kvabi.models.checkpoint import parse_dtype
from kvabi.native.cpu_kernels import CpuKernels, cpu_kernels

GENERAL = "torch SDPA"  # the general path's name in the report


@dataclass(frozen=True)
class KernelPath:
    """One phase's path: `kernel` (the native one) or None with `why` not."""

    kernel: str | None
    why: str = ""

    def __str__(self) -> str:
        return self.kernel if self.kernel is not None else f"{GENERAL}: {self.why}"


@dataclass(frozen=True)
class GroupPaths:
    """The paths of `layer_ids`: a KV group's layers with `query_heads` heads (`readers`: its
    shared layers, which read the group's KV and store none)."""

    group: KVGroup
    layer_ids: tuple[int, ...]
    query_heads: int
    readers: bool
    prefill: KernelPath
    decode: KernelPath


def compute_dtype(desc: Descriptor) -> torch.dtype:
    """The dtype the engine computes in over this descriptor: its KV dtype (the engine keeps
    unquantised KV in the model's dtype); for a quantised layout (fp8 records), the engine's
    `--dtype auto` on this CPU."""
    if desc.layout.quant != "none":
        return parse_dtype("auto")
    return torch.float32 if desc.layout.dtype == "f32" else torch.bfloat16


def attention_paths(desc: Descriptor, query_heads: Sequence[int]) -> tuple[GroupPaths, ...]:
    """Per KV group and distinct query-head count (owners, then readers): the prefill and
    decode paths of the engine's native backend over a cache in `desc`'s layout."""
    if len(query_heads) != len(desc.model.layers):
        raise ValueError(
            f"{len(query_heads)} query-head counts for {len(desc.model.layers)} layers"
        )
    cache = KVCache(desc, 2, prefix_caching=False)
    kv, kernels, dtype = LayerKV.of(cache), cpu_kernels(), compute_dtype(desc)
    rows = []
    for g in kv_groups(desc.model):
        for readers, layer_ids in ((False, g.layer_ids), (True, g.reader_ids)):
            for heads in dict.fromkeys(query_heads[i] for i in layer_ids):
                ids = tuple(i for i in layer_ids if query_heads[i] == heads)
                prefill, decode = _paths(kv, kernels, g.layer_ids[0], heads, dtype, readers,
                                         g.window)  # fmt: skip
                rows.append(GroupPaths(g, ids, heads, readers, prefill, decode))
    return tuple(rows)


def _paths(
    kv: LayerKV,
    kernels: CpuKernels | None,
    layer: int,
    heads: int,
    dtype: torch.dtype,
    reader: bool,
    window: int,
) -> tuple[KernelPath, KernelPath]:
    spec = kv.spec(layer)
    if spec.kind == CENTRIES or kv.entries_of:  # DeepSeek V4: every layer, windows too
        return KernelPath(None, COMPRESSED), KernelPath(None, COMPRESSED)
    if spec.kind == MLA and spec.indexer_dim:
        return KernelPath(None, SPARSE_MLA), KernelPath(None, SPARSE_MLA)
    if spec.kind == MLA:
        storage, slot = kv.storages[layer], kv.slots[layer]
        q = torch.zeros(1, heads, spec.latent_dim + spec.rope_dim, dtype=dtype)
        why = mla_decode_gap(kernels, storage, slot, q)
        return KernelPath(None, MLA_PREFILL), _path("kvabi_mla_decode_records", why)
    k_pool, v_pool = kv.views(layer)
    q = torch.zeros(1, heads, spec.k_dim, dtype=dtype)
    why = decode_gap(kernels, window, q, k_pool, v_pool)
    loop = ""
    if why is None:
        assert kernels is not None
        loop = kernels.paged_decode_variant(dtype, spec.k_dim, heads // spec.num_kv_heads)
    decode = _path(f"kvabi_paged_decode ({loop})", why)
    return _prefill(kernels, k_pool, window, heads, dtype, reader, spec.k_dim), decode


def _prefill(
    kernels: CpuKernels | None,
    k_pool: torch.Tensor,
    window: int,
    heads: int,
    dtype: torch.dtype,
    reader: bool,
    head_dim: int,
) -> KernelPath:
    why = prefill_gap(kernels, window, not reader, dtype, k_pool.dtype, head_dim)
    if why is None:  # a chunk of one block over two blocks of gathered context, as the engine
        assert kernels is not None
        n = 2 * k_pool.shape[1]
        q = torch.zeros(n // 2, heads, head_dim, dtype=dtype)
        k = torch.zeros(n, k_pool.shape[2], head_dim, dtype=k_pool.dtype)
        why = kernels.prefill_gap(q, k, k.clone())
    return _path(f"kvabi_prefill_attention ({kernels.gemm if kernels else '-'})", why)


def _path(kernel: str, why: str | None) -> KernelPath:
    """`kernel` where nothing stands in its way (`why` None), else the general path."""
    return KernelPath(kernel) if why is None else KernelPath(None, why)


def fused_decode_gap(desc: Descriptor, is_llama: bool) -> str | None:
    """Why the model (`is_llama`: a Llama-family one) in this descriptor gets no whole-layer
    fused decode (`FusedDecode`), judged as the engine does before it looks at the weights, or
    None: then it gets one where the weights pack for the packed GEMM (`FusedDecode.gap`)."""
    if not is_llama:
        return "not a Llama-family model"
    if not plan_groups(desc.model).is_uniform:
        return "hybrid KV groups"
    return FusedDecode.kernel_gap(cpu_kernels(), compute_dtype(desc))
