"""`ModelRunner`: turns a `ScheduledBatch` into one forward pass over the paged cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvabi.cache.block_groups import BlockGroup
from kvabi.engine.early_exit import Drafted, draft_rounds
from kvabi.engine.fused_decode import FusedDecode
from kvabi.engine.paged_attention import PagedAttention, SeqSlice, StepContext
from kvabi.engine.scheduler import ScheduledBatch, ScheduledSeq
from kvabi.engine.tp_group import TPGroup, TPStep
from kvabi.models.llama import LlamaModel


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        attention: PagedAttention,
        groups: tuple[BlockGroup, ...],
        fused: FusedDecode | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.groups = groups  # one block table per group per sequence
        self.fused = fused  # decode-only steps without a layer callback, where it applies
        self.block_size = attention.kv.block_size
        self.tp: TPGroup | None = None  # tensor parallelism: the steps go to every rank
        self.keep_hidden = False  # keep `hidden`: the sampling rows' normed hidden states
        self.hidden: torch.Tensor | None = None  # of the last `run`, where kept

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        on_layer: Callable[[int], None] | None = None,
        drafted: Drafted | None = None,
    ) -> torch.Tensor:
        """Compute the batch's tokens; return float32 logits [num sampling rows, vocab], in the
        order of the batch's sequences that sample this step (a sequence verifying a draft:
        one row per scheduled token). `on_layer(layer_id)` runs once
        each layer's K/V of the step are stored (`PagedAttention.step`). With `drafted`
        (early_exit.py), the drafted rows start at the exit layer from its kept streams."""
        if drafted is not None:
            return self._verify_from_exit(drafted, on_layer)
        ids, positions, ctxs, sample_rows = self._prepare(batch)
        if self.tp is not None:
            self.tp.send(TPStep(_copies(batch), ids, positions, tuple(ctxs)))
        if self.fused is not None and on_layer is None and not ctxs[0].prefills:
            hidden = self.fused.hidden_states(ids, positions, ctxs[0])
        else:
            with self.attention.step(ctxs, on_layer):
                hidden = self.model.hidden_states(ids, positions, self.attention)
        return self._logits(hidden[sample_rows])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden if self.keep_hidden else None
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def draft(self, batch: ScheduledBatch, exit_layer: int) -> Drafted:
        """Early-exit drafting for the batch's speculating sequences (early_exit.py)."""
        return draft_rounds(self, batch, exit_layer)

    def run_layers(
        self,
        seqs: tuple[ScheduledSeq, ...],
        ids: list[int],
        layer_ids: range,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Embed `ids` (the tokens `seqs` compute, in order) and run only `layer_ids` over the
        paged cache; return the residual stream after them [len(ids), hidden]."""
        positions = [torch.arange(s.start, s.start + s.num_tokens) for s in seqs]
        pos = torch.cat(positions)
        ctxs = tuple(self._group_context(seqs, positions, g) for g in self.groups)
        x = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long))
        with self.attention.step(ctxs, on_layer):
            return self.model.run_layers(x, pos, self.attention, layer_ids)

    def _verify_from_exit(
        self, drafted: Drafted, on_layer: Callable[[int], None] | None
    ) -> torch.Tensor:
        """Phase 2 of early-exit speculation: the other sequences' first layers, then every
        row through the layers after the exit."""
        batch, exit_layer = drafted.batch, drafted.exit_layer
        ids, positions, ctxs, sample_rows = self._prepare(batch)
        rows = torch.cat([torch.full((s.num_tokens,), bool(s.draft)) for s in batch.seqs])
        x = torch.empty(len(ids), drafted.hidden.shape[-1], dtype=drafted.hidden.dtype)
        x[rows] = drafted.hidden
        rest = tuple(s for s in batch.seqs if not s.draft)
        if rest:
            rest_ids = ids[~rows].tolist()
            x[~rows] = self.run_layers(rest, rest_ids, range(exit_layer), on_layer)
        with self.attention.step(ctxs, on_layer):
            layers = range(exit_layer, len(self.model.layers))
            hidden = self.model.norm(self.model.run_layers(x, positions, self.attention, layers))
        return self._logits(hidden[sample_rows])

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[StepContext, ...], torch.Tensor]:
        ids, positions, sample_rows = [], [], []
        start = 0
        for s in batch.seqs:
            ids += s.seq.token_slice(s.start, s.start + s.num_tokens - len(s.draft))
            ids += s.draft
            positions.append(torch.arange(s.start, s.start + s.num_tokens))
            start += s.num_tokens
            if s.draft:  # a verified draft: every position's logits
                sample_rows += range(start - s.num_tokens, start)
            elif s.samples:
                sample_rows.append(start - 1)
        pos = torch.cat(positions)
        ctxs = tuple(self._group_context(batch.seqs, positions, g) for g in self.groups)
        rows = torch.tensor(sample_rows, dtype=torch.long)  # may be empty: a prefill-only step
        return torch.tensor(ids, dtype=torch.long), pos, ctxs, rows

    def _group_context(
        self,
        seqs: tuple[ScheduledSeq, ...],
        positions: list[torch.Tensor],
        g: BlockGroup,
    ) -> StepContext:
        """One group's step context: its tables from the block the window starts at (the
        whole table for full attention; released entries read block 0, masked out). Slots
        are positions less the tokens a press took out of the cache (`num_pruned`)."""
        bs, slot_blocks, slot_offsets, slices, start = self.block_size, [], [], [], 0
        for s, p in zip(seqs, positions, strict=True):
            slot0, slots = s.start - s.seq.num_pruned, p - s.seq.num_pruned  # a press's cache
            first = max(slot0 - g.window + 1, 0) // bs if g.window else 0
            table = torch.tensor(s.seq.block_tables[g.group_id][first:], dtype=torch.long)
            slot_blocks.append(table[slots // bs - first])
            slot_offsets.append(slots % bs)
            end = slot0 + s.num_tokens
            table = table.clamp(min=0)
            slices.append(SeqSlice(start, s.num_tokens, end, table, first * bs, s.seq.seq_id))
            start += s.num_tokens
        return StepContext(
            torch.cat(slot_blocks),
            torch.cat(slot_offsets),
            tuple(slices),
            *_decode_tables(slices, bs, g.window),
            window=g.window,
        )


def _decode_tables(slices: list[SeqSlice], block_size: int, window: int) -> tuple:
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
    lens = torch.tensor([s.context_len - s.first_key for s in decodes])  # keys each table holds
    keys = torch.arange(width * block_size)[None, :]
    valid = keys < lens[:, None]  # [S, L]
    if window:
        valid &= keys >= lens[:, None] - window
    rows = torch.tensor([s.query_start for s in decodes])
    return prefills, rows, tables, lens, valid[:, None, None, :]


def _copies(batch: ScheduledBatch) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """The batch's block copies per pool, as `TPStep` carries them."""
    pools = sorted({c.pool_id for c in batch.copies})
    return tuple(
        (
            p,
            tuple(c.src for c in batch.copies if c.pool_id == p),
            tuple(c.dst for c in batch.copies if c.pool_id == p),
        )
        for p in pools
    )
