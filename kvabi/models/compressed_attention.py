"""The attention seam of DeepSeek V4: sliding-window attention over one shared K=V head, plus,
on compressed layers, the entries a compressor pools from every `ratio` tokens, with a learned
sink logit per head.

The model hands its attention, per layer, the new tokens' queries and K=V rows and a
`V4Query`: the sinks and, on a compressed layer, the compressor's rows of the new tokens with
its `emit` (and, on a CSA layer, the indexer's rows, queries and selection rule). Whoever keeps
the cache keeps, per sequence, the sliding window, the entries and each compressor's
`PoolState`; it emits the sequence's new entries from its rows and lets each query attend to
the window (keys p - window + 1 .. p), the entries whose windows closed by its position
(w < (p + 1) // ratio) and, on a CSA layer, only those of them its indexer picked.
`ContiguousCompressedAttention` is the plain reference: one sequence, whole history per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvabi.models.v4_compressor import PoolState

Emit = Callable[[PoolState, torch.Tensor, torch.Tensor], torch.Tensor]
# (queries [n, H, D], head weights [n, H], a sequence's indexer entries [E, D], positions [n])
# -> keep [n, E] bool
Select = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Series:
    """One entry series over a step's T new tokens (all sequences', flat)."""

    kv: torch.Tensor  # [T, width] the tokens' rows
    gate: torch.Tensor  # [T, width] their gates
    emit: Emit  # (a sequence's state, its rows, its gates) -> its new entries [w, D]


@dataclass(frozen=True)
class IndexQuery:
    """A CSA layer's lightning indexer over a step's T new tokens."""

    series: Series  # its own entries (index_head_dim wide)
    queries: torch.Tensor  # [T, index_n_heads, index_head_dim] post-RoPE
    weights: torch.Tensor  # [T, index_n_heads] float32
    select: Select

    def keep(self, rows: slice, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.select(self.queries[rows], self.weights[rows], entries, positions)


@dataclass(frozen=True)
class V4Query:
    sinks: torch.Tensor  # [num_heads] float32: a logit per head that takes probability, no value
    scale: float  # the scores' scale, head_dim^-0.5
    ratio: int = 0  # tokens pooled per entry (0: a sliding layer, no entries)
    entries: Series | None = None
    index: IndexQuery | None = None  # CSA only


class CompressedAttentionFn(Protocol):
    keeps_compressed: bool  # True: it keeps entries and compressor states per sequence

    def __call__(
        self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, query: V4Query
    ) -> torch.Tensor:
        """q [T, H, D], kv [T, 1, D] (post-RoPE; K and V alike) -> [T, H, D]."""
        ...


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """HF's eager V4 attention for one sequence: q [n, H, D], keys (= values) [L, D], keep
    [n, L] bool, sinks [H] -> [n, H, D]. The sink joins each row's softmax and is dropped."""
    scores = torch.matmul(q.transpose(0, 1), keys.T) * scale  # [H, n, L]
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.reshape(-1, 1, 1).expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)  # [n, H, D]


def visible_keys(positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool [n, L]: key at position j is visible to the query at p when p - window < j <= p."""
    delta = positions[:, None] - key_positions[None, :]
    return (delta >= 0) & (delta < window)


def visible_entries(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """Bool [n, E]: entry w is visible to the query at p once its window closed,
    w < (p + 1) // ratio."""
    return torch.arange(num_entries)[None, :] < ((positions + 1) // ratio)[:, None]


class ContiguousCompressedAttention:
    """One sequence's V4 cache, whole: every layer's K=V rows (a query still sees only its
    window), entries and compressor states. The reference the paged engine is tested against."""

    keeps_compressed = True

    def __init__(self, num_layers: int, window: int) -> None:
        self.window = window
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [L, D]
        self.entries: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.states: list[dict[str, PoolState]] = [{} for _ in range(num_layers)]

    def __call__(
        self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, query: V4Query
    ) -> torch.Tensor:
        held = self.keys[layer_id]
        start = 0 if held is None else held.shape[0]
        keys = kv[:, 0] if held is None else torch.cat([held, kv[:, 0]])
        self.keys[layer_id] = keys
        positions = torch.arange(start, start + q.shape[0])
        keep = visible_keys(positions, torch.arange(keys.shape[0]), self.window)
        if query.entries is not None:
            entries = self._emit(layer_id, "compressor", query.entries)
            seen = visible_entries(positions, entries.shape[0], query.ratio)
            if query.index is not None:
                index_entries = self._emit(layer_id, "indexer", query.index.series)
                seen &= query.index.keep(slice(None), index_entries, positions)
            keys = torch.cat([keys, entries])
            keep = torch.cat([keep, seen], dim=1)
        return sink_attention(q, keys, keep, query.sinks, query.scale)

    def _emit(self, layer_id: int, name: str, series: Series) -> torch.Tensor:
        state = self.states[layer_id].setdefault(name, PoolState())
        new = series.emit(state, series.kv, series.gate)
        held = self.entries[layer_id].get(name)
        entries = new if held is None else torch.cat([held, new])
        self.entries[layer_id][name] = entries
        return entries
