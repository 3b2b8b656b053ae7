"""Attention over block tables: the `AttentionFn` the model calls, per layer, inside a step.

The step's metadata (`StepContext`) is the only ambient state: `with attention.step(ctx):` around
the forward. Each call first writes the new tokens' K/V into their slots, then attends.
Three backends compute the same thing: `reference` (one sequence at a time, plain gather + SDPA:
easy to read), `batched` (all single-token decodes of the step in one padded SDPA call; chunks of
prefill per sequence) and `native` (as `batched`, but decodes go to a C++ kernel that reads K/V in
place through the block tables, and bf16 prefill chunks on a CPU with AMX to a C++ tile kernel:
`kvabi/native/cpu_kernels.py`; where they cannot be built, `batched` runs).
Tests compare them.

A hybrid model's layers belong to block groups (kvabi/cache/block_groups.py): each group has
its own block tables and so its own `StepContext`; a sliding group's context holds only the
blocks its window reaches (`SeqSlice.first_key` on) and masks keys the window excludes. Layers
that share an earlier layer's KV (k = v = None) read that layer's views and store nothing.
An MLA layer (DeepSeek; k = c_kv, v = k_pe, q absorbed: `AttentionFn`) stores its latents side
by side and attends over [c_kv | k_pe] with c_kv as the values (`_attend_mla`); a DeepSeek
V3.2 layer (`index`: its lightning indexer) also stores its indexer keys and attends only to the
latents they pick (`kvabi/engine/sparse_mla.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvabi.abi.descriptor import MLA, LayerSpec
from kvabi.cache.kv_cache import KVCache
from kvabi.cache.kv_storage import KVStorage
from kvabi.engine.attention_path import decode_gap, mla_decode_gap, prefill_gap
from kvabi.engine.compressed_paged import (
    CompressorStates,
    attend_compressed,
    entry_layers,
    store_entries,
)
from kvabi.engine.press import PressJob
from kvabi.engine.sparse_mla import attend_sparse_mla
from kvabi.models.attention import causal_mask
from kvabi.models.compressed_attention import V4Query
from kvabi.models.sparse_attention import IndexerQuery
from kvabi.native.cpu_kernels import CpuKernels, cpu_kernels

BACKENDS = ("native", "batched", "reference")


@dataclass(frozen=True)
class SeqSlice:
    query_start: int  # rows of this sequence in the step's flat tokens
    num_queries: int
    context_len: int  # tokens of K/V after this step (positions 0 .. context_len-1)
    block_table: torch.Tensor  # [num_blocks] int64, from block first_key // block_size on
    first_key: int = 0  # position of the first key it holds (a sliding window's start)
    seq_id: int = -1  # the sequence (its state between steps: DeepSeek V4's compressors)


@dataclass(frozen=True)
class StepContext:
    """One block group's view of a step (a uniform model has one group)."""

    slot_blocks: torch.Tensor  # [num_tokens] int64: block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot in that block
    seqs: tuple[SeqSlice, ...]
    prefills: tuple[SeqSlice, ...]  # sequences with more than one query this step
    decode_query_rows: torch.Tensor  # [num_decodes] rows of the single-query sequences
    decode_tables: torch.Tensor  # [num_decodes, max_blocks] padded block tables
    decode_lens: torch.Tensor  # [num_decodes] int64 keys each decode's table holds
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size]: key is valid
    window: int = 0  # the group's sliding window; 0 = full attention


@dataclass(frozen=True)
class LayerKV:
    """Per model layer: the storage its K/V live in and its slot there (a shared layer: its
    target's), its block group and whether it stores (owns KV)."""

    storages: tuple[KVStorage, ...]
    slots: tuple[int, ...]
    group_ids: tuple[int, ...]
    is_owner: tuple[bool, ...]
    block_size: int
    is_mla: tuple[bool, ...]
    entries_of: dict[int, int]  # DeepSeek V4: attention layer -> its compressed entries' layer

    @classmethod
    def of(cls, cache: KVCache) -> LayerKV:
        layers = cache.desc.model.layers
        where = [cache.layer_storage(i) for i in range(len(layers))]
        return cls(
            tuple(storage for storage, _ in where),
            tuple(slot for _, slot in where),
            tuple(cache.plan.group_of(i) for i in range(len(layers))),
            tuple(x.has_kv for x in layers),
            cache.block_size,
            tuple(x.kind == MLA for x in layers),
            entry_layers(layers),
        )

    def mla_keys(self, layer_id: int, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An MLA layer's [latent | rope] of the blocks `table`, [*table.shape, block_size, 1,
        latent + rope], in `dtype` (records dequantised)."""
        return self.storages[layer_id].mla_keys(self.slots[layer_id], table, dtype)

    def spec(self, layer_id: int) -> LayerSpec:
        """The layer's spec in its storage's descriptor."""
        return self.storages[layer_id].desc.model.layers[self.slots[layer_id]]

    def write_indexer(self, layer_id: int, ctx: StepContext, keys: torch.Tensor) -> None:
        """Store new tokens' indexer keys [T, D] (DeepSeek V3.2) at their slots."""
        storage = self.storages[layer_id]
        storage.write_indexer(self.slots[layer_id], ctx.slot_blocks, ctx.slot_offsets, keys)

    def indexer_keys(self, layer_id: int, s: SeqSlice) -> torch.Tensor:
        """A sequence's cached indexer keys, float32 [context_len, D] (dequantised)."""
        return self.storages[layer_id].indexer_keys(
            self.slots[layer_id], s.block_table, s.context_len
        )

    def views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V, each [block, slot, heads, dim]."""
        storage, slot = self.storages[layer_id], self.slots[layer_id]
        return storage.k[slot], storage.v[slot]

    def write(self, layer_id: int, ctx: StepContext, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V [T, heads, dim] at their slots."""
        storage = self.storages[layer_id]
        storage.write(self.slots[layer_id], ctx.slot_blocks, ctx.slot_offsets, k, v)

    def gather(self, layer_id: int, s: SeqSlice) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V from `first_key` to `context_len`, each [n, heads, dim]."""
        storage, n = self.storages[layer_id], s.context_len - s.first_key
        return storage.gather(self.slots[layer_id], s.block_table, n)


class PagedAttention:
    def __init__(self, kv: LayerKV, backend: str = "native") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"attention backend: one of {BACKENDS}, got {backend!r}")
        self.kv = kv
        self.kernels: CpuKernels | None = None
        if backend == "native":
            self.kernels = cpu_kernels()
            backend = "native" if self.kernels else "batched"
        self.backend = backend  # the one in use
        self._ctxs: tuple[StepContext, ...] = ()
        self._on_layer: Callable[[int], None] | None = None
        self.compressors = CompressorStates()  # DeepSeek V4: per running sequence
        self.presses: dict[int, PressJob] = {}  # sequences whose context a press ends this step

    @contextmanager
    def step(
        self, ctxs: tuple[StepContext, ...], on_layer: Callable[[int], None] | None = None
    ) -> Iterator[None]:
        """Inside it the model's attention calls see `ctxs` (one per block group);
        `on_layer(layer_id)` runs after each layer's new K/V are stored, before that layer
        attends (the next layer runs after it returns)."""
        self._ctxs, self._on_layer = ctxs, on_layer
        try:
            yield
        finally:
            self._ctxs, self._on_layer = (), None

    # a `CompressedAttentionFn` too: DeepSeek V4's calls (a `V4Query`) go to `_attend_v4`
    keeps_compressed = True

    @property
    def keeps_indexer(self) -> bool:
        """Whether it keeps DeepSeek V3.2's indexer keys (its cache has the sidecar plane), as
        a `SparseAttentionFn`."""
        return any(storage.has_indexer for storage in self.kv.storages)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        index: IndexerQuery | None = None,
    ) -> torch.Tensor:
        assert self._ctxs, "attention called outside `with attention.step(ctxs)`"
        if isinstance(v, V4Query):  # DeepSeek V4: k is the window's K=V rows
            return self._attend_v4(layer_id, q, k, v)
        ctx = self._ctxs[self.kv.group_ids[layer_id]]
        if self.kv.is_owner[layer_id]:
            assert k is not None and v is not None
            self.kv.write(layer_id, ctx, k, v)
            if index is not None:  # with the latents, before anyone may read the layer
                self.kv.write_indexer(layer_id, ctx, index.keys)
            if self.presses:
                self._choose_kept(layer_id, q, ctx)
        if self._on_layer is not None:
            self._on_layer(layer_id)
        if index is not None:
            return attend_sparse_mla(self.kv, layer_id, q, ctx, index)
        if self.kv.is_mla[layer_id]:
            return self._attend_mla(layer_id, q, ctx)
        if self.backend != "reference" and not ctx.prefills:  # decodes only: rows 0..n-1
            return self._attend_decodes(layer_id, q, ctx)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        if self.backend == "reference":
            for s in ctx.seqs:
                self._attend_one(layer_id, q, out, s)
            return out
        for s in ctx.prefills:
            self._attend_one(layer_id, q, out, s, k, v)
        if len(ctx.decode_query_rows):
            rows = ctx.decode_query_rows
            out[rows] = self._attend_decodes(layer_id, q[rows], ctx)
        return out

    def _choose_kept(self, layer_id: int, q: torch.Tensor, ctx: StepContext) -> None:
        """For each sequence a press ends this step: the layer's kept context tokens, from its
        keys (all stored now) and its queries (press.py)."""
        for s in ctx.seqs:
            job = self.presses.get(s.seq_id)
            if job is not None:
                keys, _ = self.kv.gather(layer_id, s)  # [context, H_kv, D]
                rows = q[s.query_start : s.query_start + s.num_queries]
                job.choose(layer_id, rows, keys.to(q.dtype))

    def _attend_v4(
        self, layer_id: int, q: torch.Tensor, rows: torch.Tensor, query: V4Query
    ) -> torch.Tensor:
        """DeepSeek V4 (kvabi/engine/compressed_paged.py): store the window's rows and the
        compressed layer's new entries, then attend per sequence."""
        ctxs = self._ctxs
        self.kv.write(layer_id, ctxs[self.kv.group_ids[layer_id]], rows, rows)  # K = V
        entries_id = self.kv.entries_of.get(layer_id)
        if entries_id is not None and query.entries is not None:
            store_entries(self.kv, self.compressors, layer_id, query, ctxs)
        if self._on_layer is not None:  # the entries' layers follow every attention layer
            self._on_layer(layer_id)
            entry_ids = sorted(self.kv.entries_of.values())
            if entry_ids and layer_id == entry_ids[0] - 1:  # the last attention layer
                for i in entry_ids:
                    self._on_layer(i)
        return attend_compressed(self.kv, layer_id, q, query, ctxs)

    def _attend_one(
        self,
        layer_id: int,
        q: torch.Tensor,
        out: torch.Tensor,
        s: SeqSlice,
        new_k: torch.Tensor | None = None,
        new_v: torch.Tensor | None = None,
    ) -> None:
        rows = slice(s.query_start, s.query_start + s.num_queries)
        kernels, window = self.kernels, self._ctxs[self.kv.group_ids[layer_id]].window
        kv_dtype = self.kv.views(layer_id)[0].dtype
        if (
            kernels is not None
            and new_k is not None
            and new_v is not None
            and prefill_gap(kernels, window, True, q.dtype, kv_dtype, q.shape[-1]) is None
        ):
            # native backend, bf16 with AMX: the C++ kernel, on the new K/V or the gathered
            # context (same causal rule: the chunk's queries are the context's last positions)
            if s.context_len == s.num_queries:
                k, v = new_k[rows], new_v[rows]
            else:
                k, v = self.kv.gather(layer_id, s)
                k, v = k.contiguous(), v.contiguous()
            if kernels.prefill_gap(q[rows], k, v) is None:
                out[rows] = kernels.prefill_attention(q[rows], k, v)
                return
        qs = q[rows].transpose(0, 1)  # [H, Tq, D]
        if new_k is not None and window == 0 and s.context_len == s.num_queries > 1:
            # a whole prompt in one chunk: its own K/V are the context, plain causal attention
            k, v, mask, causal = new_k[rows], new_v[rows], None, True
        else:
            k, v = self.kv.gather(layer_id, s)  # [ctx - first_key, H_kv, D]
            mask = causal_mask(s.num_queries, s.context_len, window, first_key=s.first_key)
            causal = False
        # 4-D inputs: torch's CPU flash kernel takes them; 3-D ones fall back to the math path
        o = F.scaled_dot_product_attention(
            qs[None],
            k.transpose(0, 1).to(q.dtype)[None],
            v.transpose(0, 1).to(q.dtype)[None],
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)

    def _attend_decodes(self, layer_id: int, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q [S, H, D] (one query per sequence) -> [S, H, D], with padded K/V gathers."""
        k_pool, v_pool = self.kv.views(layer_id)
        kernels = self.kernels
        if kernels is not None and decode_gap(kernels, ctx.window, q, k_pool, v_pool) is None:
            return kernels.paged_decode(q, k_pool, v_pool, ctx.decode_tables, ctx.decode_lens)
        k = k_pool[ctx.decode_tables].flatten(1, 2)  # [S, L, H_kv, D]
        v = v_pool[ctx.decode_tables].flatten(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2).to(q.dtype),
            v.transpose(1, 2).to(q.dtype),
            attn_mask=ctx.decode_mask,
            enable_gqa=True,
        )  # [S, H, 1, D]
        return o.squeeze(2)

    def _attend_mla(self, layer_id: int, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Absorbed MLA over the paged latents: q [T, H, latent + rope] -> [T, H, latent]; one
        key head [latent | rope] per token, its latent as the value: SDPA per prefill chunk;
        the step's decodes in one padded SDPA call over the dequantised keys, or (native
        backend, fp8_ds_mla records) the C++ kernel reading the records in place."""
        latent = self.kv.spec(layer_id).latent_dim
        out = q.new_empty((*q.shape[:-1], latent))
        prefills = ctx.seqs if self.backend == "reference" else ctx.prefills
        for s in prefills:
            rows = slice(s.query_start, s.query_start + s.num_queries)
            keys = self.kv.mla_keys(layer_id, s.block_table, q.dtype).flatten(0, 1)
            keys = keys[: s.context_len - s.first_key, 0]  # [L, latent + rope]
            mask = causal_mask(s.num_queries, s.context_len, ctx.window, first_key=s.first_key)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys[None, None], keys[None, None, :, :latent],
                attn_mask=mask, enable_gqa=True,
            )  # fmt: skip
            out[rows] = o[0].transpose(0, 1)
        if self.backend != "reference" and len(ctx.decode_query_rows):
            rows = ctx.decode_query_rows
            storage, slot = self.kv.storages[layer_id], self.kv.slots[layer_id]
            records = storage.joint[slot]
            kernels = self.kernels  # set for the native backend only
            if kernels is not None and mla_decode_gap(kernels, storage, slot, q) is None:
                lens = ctx.decode_lens  # the C++ kernel reads the 656-byte records in place
                o = kernels.mla_decode_records(q[rows], records, ctx.decode_tables, lens)
                out[rows] = o.to(q.dtype)
                return out
            keys = self.kv.mla_keys(layer_id, ctx.decode_tables, q.dtype)  # [S, nb, N, 1, C]
            keys = keys.flatten(1, 2).transpose(1, 2)  # [S, 1, L, latent + rope]
            o = F.scaled_dot_product_attention(  # [S, H, 1, latent]
                q[rows].unsqueeze(2), keys, keys[..., :latent], attn_mask=ctx.decode_mask,
                enable_gqa=True,
            )  # fmt: skip
            out[rows] = o.squeeze(2)
        return out
