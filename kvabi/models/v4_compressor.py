"""DeepSeek V4's compressors and lightning indexer, equal to transformers 5.24's
`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor` and `DeepseekV4Indexer` (float32, HF's
operation order).

A compressor turns every `m` tokens of a sequence into one entry: each token's row
`C = kv_proj(x)` is weighted by `softmax(gate_proj(x) + position_bias)` over its window, summed,
RMS-normed and rotated (interleaved RoPE on the trailing `qk_rope_head_dim` channels, the
"compress" table) at the window's first position. With `overlap` (CSA, and its indexer) rows are
twice as wide: each token's first half (Ca) joins the next window's entry, its second half (Cb)
its own window's, so entry w pools 2m rows (window w - 1's Ca, window w's Cb).

The rows of a window still open, and the last closed window's Ca, are the sequence's
`PoolState`: whoever keeps the sequence's cache keeps it too and hands it to `emit` with each
step's new rows, so a sequence emits the same entries however its tokens are chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvabi.models.v4_rope import V4RMSNorm, V4Rope, apply_v4_rope


@dataclass
class PoolState:
    """One sequence's compressor state for one entry series of one layer."""

    kv: torch.Tensor | None = None  # [b, width] rows of the window still open (b < m)
    gate: torch.Tensor | None = None  # [b, width] their gates (position bias not yet added)
    overlap_kv: torch.Tensor | None = None  # [m, head_dim] overlap: the last closed window's Ca
    overlap_gate: torch.Tensor | None = None  # [m, head_dim] its gates (position bias added)
    num_entries: int = 0  # entries emitted so far: the next window starts at num_entries * m

    @property
    def num_buffered(self) -> int:
        return 0 if self.kv is None else self.kv.shape[0]


class Compressor(nn.Module):
    """One entry series' weights (HF names: `kv_proj`, `gate_proj`, `position_bias`, `kv_norm`)
    and its pooling."""

    def __init__(
        self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float
    ) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = head_dim * (2 if overlap else 1)
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(head_dim, eps)

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (kv, gate) [T, width]: the tokens' rows, for `emit`."""
        return self.kv_proj(x), self.gate_proj(x)

    def emit(
        self, state: PoolState, kv: torch.Tensor, gate: torch.Tensor, rope: V4Rope
    ) -> torch.Tensor:
        """One sequence's new rows [n, width] -> the entries their windows close [w, head_dim]
        (post-norm, post-RoPE); `state` is updated (HF's `store_compression_weights`)."""
        first = state.num_entries * self.ratio  # the first closed window's first position
        if state.kv is not None and state.kv.shape[0]:
            kv, gate = torch.cat([state.kv, kv]), torch.cat([state.gate, gate])
        usable = kv.shape[0] // self.ratio * self.ratio
        state.kv, state.gate = kv[usable:], gate[usable:]
        if not usable:
            return kv.new_zeros((0, self.head_dim))
        num_windows = usable // self.ratio
        chunk_kv = kv[:usable].view(num_windows, self.ratio, -1)
        chunk_gate = gate[:usable].view(num_windows, self.ratio, -1) + self.position_bias
        if self.overlap:
            chunk_kv, chunk_gate = self._overlap(state, chunk_kv, chunk_gate)
        weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
        pooled = self.kv_norm((chunk_kv * weights).sum(dim=1))  # [w, head_dim]
        positions = torch.arange(num_windows) * self.ratio + first
        cos, sin = rope(positions, pooled.dtype)  # [w, rope / 2]
        state.num_entries += num_windows
        return apply_v4_rope(pooled, cos, sin)

    def _overlap(
        self, state: PoolState, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[w, m, 2D] rows -> [w, 2m, D]: window w - 1's Ca, then window w's Cb (the window
        before the first: the state's, or nothing, a -inf gate)."""
        d, m = self.head_dim, self.ratio
        num_windows = chunk_kv.shape[0]
        new_kv = chunk_kv.new_zeros((num_windows, 2 * m, d))
        new_gate = chunk_gate.new_full((num_windows, 2 * m, d), float("-inf"))
        new_kv[:, m:], new_gate[:, m:] = chunk_kv[..., d:], chunk_gate[..., d:]
        new_kv[1:, :m], new_gate[1:, :m] = chunk_kv[:-1, :, :d], chunk_gate[:-1, :, :d]
        if state.overlap_kv is not None:
            new_kv[0, :m] = state.overlap_kv.to(new_kv.dtype)
            new_gate[0, :m] = state.overlap_gate.to(new_gate.dtype)
        state.overlap_kv = chunk_kv[-1, :, :d].clone()
        state.overlap_gate = chunk_gate[-1, :, :d].clone()
        return new_kv, new_gate


class IndexScorer(nn.Module):
    """HF's `scorer`: the indexer heads' weights per token."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at
    `index_head_dim`, and queries scoring its entries `sum_h w_h relu(q_h . k) / sqrt(D)`; each
    query keeps its top `topk` among the entries it may see."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int,
        ratio: int, topk: int, eps: float,
    ) -> None:  # fmt: skip
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.num_heads, self.topk = num_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.scorer = IndexScorer(hidden_size, num_heads)

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H, D] post-RoPE at the tokens' positions, head weights [T, H] f32)."""
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, self.head_dim)
        q = apply_v4_rope(q, cos[:, None], sin[:, None])
        return q, self.scorer.weights_proj(x).float() * self.num_heads**-0.5

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Bool [n, E]: the entries each query (at `positions` [n]) attends, among a sequence's
        E indexer entries [E, D]: its top `topk` of those whose window closed by its position."""
        num_entries = entries.shape[0]
        scores = torch.matmul(q[None].float(), entries.T.float()[None, None])  # [1, n, H, E]
        scores = F.relu(scores) * self.head_dim**-0.5
        index = (scores * weights[None, :, :, None]).sum(dim=2)[0]  # [n, E]
        threshold = ((positions + 1) // self.ratio)[:, None]  # [n, 1]
        visible = torch.arange(num_entries)[None, :] < threshold
        index = index.masked_fill(~visible, float("-inf"))
        picked = index.topk(min(self.topk, num_entries), dim=-1).indices  # [n, k]
        picked = torch.where(picked < threshold, picked, num_entries)  # invalid: a spare column
        keep = torch.zeros(q.shape[0], num_entries + 1, dtype=torch.bool)
        return keep.scatter_(1, picked, True)[:, :num_entries]
