"""DeepSeek V4's attention over the paged cache: each layer's window of K=V rows in its sliding
block group, each compressed layer's entries in a full block group of its own kind (a block of
N tokens holds N / ratio entries, the indexer's beside them on CSA), and the compressors' state.

The compressors run per sequence (`Series.emit`, the model's arithmetic): a sequence's rows of
a window still open and, on CSA, its last closed window's first-half rows (the overlap the next
entry pools) are its `PoolState`s, kept here between steps (`CompressorStates`, by sequence id,
with the token count they cover). Every block is a whole number of windows, so at a block's end
no window is open: what a sequence needs to go on from there is the overlap alone, which is
written into the block's `state` record when its last window closes. A sequence that starts at
a block boundary from blocks it did not compute (a prefix hit, a tier load, a transfer, a
re-admission after preemption) restores its state from there; one that resumes mid-block
without its state is refused (it cannot happen: hits, loads and transfers are whole blocks).

Each sequence is attended alone, in HF's shapes (`sink_attention`): a batch gives what each
sequence alone would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvabi.abi.descriptor import CENTRIES, LayerSpec
from kvabi.cache.kv_storage import KVStorage
from kvabi.models.compressed_attention import (
    Series,
    V4Query,
    sink_attention,
    visible_entries,
    visible_keys,
)
from kvabi.models.v4_compressor import PoolState

if TYPE_CHECKING:
    from kvabi.engine.paged_attention import LayerKV, SeqSlice, StepContext

SERIES = ("compressor", "indexer")  # a CSA layer's two entry series, in their record's order


@dataclass
class LayerState:
    num_tokens: int  # the sequence's tokens the states cover
    series: dict[str, PoolState] = field(default_factory=dict)


class CompressorStates:
    """Per running sequence, per compressed layer, its compressors' states."""

    def __init__(self) -> None:
        self._seqs: dict[int, dict[int, LayerState]] = {}

    def get(
        self, seq_id: int, layer_id: int, num_tokens: int, restore: Callable[[], LayerState]
    ) -> LayerState:
        """The states covering the sequence's first `num_tokens` tokens (`restore`d from the
        cache where those kept are for another count: the sequence restarted)."""
        layers = self._seqs.setdefault(seq_id, {})
        state = layers.get(layer_id)
        if state is None or state.num_tokens != num_tokens:
            state = layers[layer_id] = restore()
        return state

    def retain(self, seq_ids: set[int]) -> None:
        """Forget every sequence but these (the running ones)."""
        for seq_id in set(self._seqs) - seq_ids:
            del self._seqs[seq_id]

    def __len__(self) -> int:
        return len(self._seqs)


def entry_layers(layers: tuple[LayerSpec, ...]) -> dict[int, int]:
    """Attention layer -> the centries layer holding its entries."""
    return {x.compresses: i for i, x in enumerate(layers) if x.kind == CENTRIES}


def store_entries(
    kv: LayerKV,
    states: CompressorStates,
    layer_id: int,
    query: V4Query,
    ctxs: tuple[StepContext, ...],
) -> None:
    """Run each sequence's new rows through the compressed layer's compressors; store the
    entries they close (and the overlap at each block's end) in the layer's centries layer."""
    entries_id = kv.entries_of[layer_id]
    storage, slot, spec = kv.storages[entries_id], kv.slots[entries_id], kv.spec(entries_id)
    series = {"compressor": query.entries}
    if query.index is not None:
        series["indexer"] = query.index.series
    for s in ctxs[kv.group_ids[entries_id]].seqs:
        start = s.context_len - s.num_queries

        def restore(s: SeqSlice = s, start: int = start) -> LayerState:
            return _restore(storage, slot, spec, s, start)

        state = states.get(s.seq_id, entries_id, start, restore)
        _emit(storage, slot, spec, s, state, series, s.query_start)


def attend_compressed(
    kv: LayerKV, layer_id: int, q: torch.Tensor, query: V4Query, ctxs: tuple[StepContext, ...]
) -> torch.Tensor:
    """q [T, H, D] over each sequence's window of K=V rows and, on a compressed layer, the
    entries it sees (stored first: `store_entries`) -> [T, H, D]."""
    ctx = ctxs[kv.group_ids[layer_id]]
    entries_id = kv.entries_of.get(layer_id)
    out = torch.empty_like(q)
    for i, s in enumerate(ctx.seqs):
        span = slice(s.query_start, s.query_start + s.num_queries)
        positions = torch.arange(s.context_len - s.num_queries, s.context_len)
        keys, _ = kv.gather(layer_id, s)  # [L, 1, D] from the window's first key
        keep = visible_keys(positions, torch.arange(s.first_key, s.context_len), ctx.window)
        keys = keys[:, 0]
        if entries_id is not None:
            e = ctxs[kv.group_ids[entries_id]].seqs[i]
            entries, seen = _entries(kv, entries_id, e, span, positions, query)
            keys, keep = torch.cat([keys, entries]), torch.cat([keep, seen], dim=1)
        out[span] = sink_attention(q[span], keys.to(q.dtype), keep, query.sinks, query.scale)
    return out


def _entries(
    kv: LayerKV,
    layer_id: int,
    s: SeqSlice,
    span: slice,
    positions: torch.Tensor,
    query: V4Query,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's entries [E, D] and which of them each of its queries sees [n, E]."""
    spec = kv.spec(layer_id)
    num_entries = s.context_len // spec.ratio
    stored = kv.storages[layer_id].read_rows(kv.slots[layer_id], s.block_table, num_entries)
    seen = visible_entries(positions, num_entries, spec.ratio)
    if query.index is not None:  # [E, D + Di]: the indexer's entries after the layer's
        seen &= query.index.keep(span, stored[:, spec.latent_dim :], positions)
    return stored[:, : spec.latent_dim], seen


def _emit(
    storage: KVStorage,
    slot: int,
    spec: LayerSpec,
    s: SeqSlice,
    state: LayerState,
    series: dict[str, Series],
    row0: int,
) -> None:
    """Run the sequence's new rows (from step row `row0`) through each series a block at a
    time, storing the entries each closes and, at each block's end, the overlap state."""
    bs = storage.block_size
    first, end = state.num_tokens, s.context_len
    cut = first
    while cut < end:
        stop = min((cut // bs + 1) * bs, end)
        rows = slice(row0 + cut - first, row0 + stop - first)
        new = [
            series[name].emit(state.series[name], series[name].kv[rows], series[name].gate[rows])
            for name in SERIES
            if name in series
        ]
        if len(new[0]):
            entry_ids = torch.arange(len(new[0])) + state.series["compressor"].num_entries
            entry_ids -= len(new[0])
            tokens = entry_ids * spec.ratio
            blocks = s.block_table[tokens // bs]
            storage.write_rows(slot, blocks, (tokens % bs) // spec.ratio, torch.cat(new, dim=-1))
        if stop % bs == 0 and spec.overlap:
            _save_overlap(storage, slot, int(s.block_table[stop // bs - 1]), state)
        cut = stop
    state.num_tokens = end


def _save_overlap(storage: KVStorage, slot: int, block_id: int, state: LayerState) -> None:
    parts = []
    for name in SERIES:
        pool = state.series.get(name)
        if pool is not None:
            parts += [pool.overlap_kv.float().flatten(), pool.overlap_gate.float().flatten()]
    storage.state(slot, block_id).copy_(torch.cat(parts))


def _restore(
    storage: KVStorage, slot: int, spec: LayerSpec, s: SeqSlice, num_tokens: int
) -> LayerState:
    """The states at the sequence's `num_tokens` (a block boundary) from its cached blocks."""
    bs = storage.block_size
    if num_tokens % bs:
        raise RuntimeError(
            f"compressed layer: sequence {s.seq_id} resumes at token {num_tokens}, inside a "
            f"block of {bs}, without its compressor state"
        )
    names = SERIES if spec.indexer_dim else SERIES[:1]
    widths = {"compressor": spec.latent_dim, "indexer": spec.indexer_dim}
    state = LayerState(num_tokens)
    record = storage.state(slot, int(s.block_table[num_tokens // bs - 1])) if (
        spec.overlap and num_tokens
    ) else None  # fmt: skip
    offset = 0
    for name in names:
        pool = PoolState(num_entries=num_tokens // spec.ratio)
        if record is not None:
            size = spec.ratio * widths[name]
            kv, gate = record[offset : offset + size], record[offset + size : offset + 2 * size]
            pool.overlap_kv = kv.view(spec.ratio, widths[name]).clone()
            pool.overlap_gate = gate.view(spec.ratio, widths[name]).clone()
            offset += 2 * size
        state.series[name] = pool
    return state
