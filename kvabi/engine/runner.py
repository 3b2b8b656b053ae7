"""`ModelRunner`: turns a `ScheduledBatch` into one forward pass over the paged cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvabi.engine.fused_decode import FusedDecode
from kvabi.engine.paged_attention import PagedAttention, SeqSlice, StepContext
from kvabi.engine.scheduler import ScheduledBatch
from kvabi.models.llama import LlamaModel


class ModelRunner:
    def __init__(
        self, model: LlamaModel, attention: PagedAttention, fused: FusedDecode | None = None
    ) -> None:
        self.model = model
        self.attention = attention
        self.fused = fused  # decode-only steps without a layer callback, where it applies
        self.block_size = attention.storage.block_size

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Compute the batch's tokens; return float32 logits [num sampling seqs, vocab], in the
        order of the batch's sequences that sample this step. `on_layer(layer_id)` runs once
        each layer's K/V of the step are stored (`PagedAttention.step`)."""
        ids, positions, ctx, sample_rows = self._prepare(batch)
        if self.fused is not None and on_layer is None and not ctx.prefills:
            hidden = self.fused.hidden_states(ids, positions, ctx)
            return self.model.compute_logits(hidden[sample_rows]).float()
        with self.attention.step(ctx, on_layer):
            hidden = self.model.hidden_states(ids, positions, self.attention)
        return self.model.compute_logits(hidden[sample_rows]).float()

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor]:
        ids, positions, slot_blocks, slices, sample_rows = [], [], [], [], []
        start = 0
        for s in batch.seqs:
            ids += s.seq.token_slice(s.start, s.start + s.num_tokens)
            pos = torch.arange(s.start, s.start + s.num_tokens)
            table = torch.tensor(s.seq.block_ids, dtype=torch.long)
            positions.append(pos)
            slot_blocks.append(table[pos // self.block_size])
            slices.append(SeqSlice(start, s.num_tokens, s.start + s.num_tokens, table))
            start += s.num_tokens
            if s.samples:
                sample_rows.append(start - 1)
        pos = torch.cat(positions)
        ctx = StepContext(
            torch.cat(slot_blocks),
            pos % self.block_size,
            tuple(slices),
            *_decode_tables(slices, self.block_size),
        )
        rows = torch.tensor(sample_rows, dtype=torch.long)  # may be empty: a prefill-only step
        return torch.tensor(ids, dtype=torch.long), pos, ctx, rows


def _decode_tables(slices: list[SeqSlice], block_size: int) -> tuple:
    """Step-wide decode metadata, built once instead of once per layer: the prefilling slices,
    the decode query rows, padded block tables, context lengths and the key-validity mask."""
    prefills = tuple(s for s in slices if s.num_queries > 1)
    decodes = [s for s in slices if s.num_queries == 1]
    if not decodes:
        empty = torch.zeros(0, dtype=torch.long)
        mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool)
        return prefills, empty, empty.view(0, 0), empty, mask
    width = max(len(s.block_table) for s in decodes)
    tables = torch.zeros(len(decodes), width, dtype=torch.long)  # padding reads block 0, masked
    for r, s in enumerate(decodes):
        tables[r, : len(s.block_table)] = s.block_table
    lens = torch.tensor([s.context_len for s in decodes])
    valid = torch.arange(width * block_size)[None, :] < lens[:, None]  # [S, L]
    rows = torch.tensor([s.query_start for s in decodes])
    return prefills, rows, tables, lens, valid[:, None, None, :]
