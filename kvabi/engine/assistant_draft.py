"""Speculation with a Gemma 4 assistant drafter that reads the target's own paged cache
(`speculative="assistant:k=K"` with `EngineConfig.draft_model`, kvabi/models/gemma4_assistant.py).

The assistant keeps no cache: each step, for every speculating sequence whose last token t
sits at position P, it reads the K/V the target stored at its feeding layers (per layer type,
the last one before the KV-shared layers) for the tokens before P, straight from the blocks of
that layer's group, and drafts k tokens in k rounds at the fixed position P from the target's
normed hidden state at P - 1 (kept per sequence by the engine from the step that computed it).
The scheduler asked for k placeholder slots (`spec_decode.PendingDrafter`); `fill` replaces
them before the verifying forward, which then runs as for any draft. Rejected tokens' K/V lie
past `num_computed` and are trimmed as usual.

A sliding layer of the assistant reads the last `sliding_window + 1` keys before P, while the
target's own window at P reaches back `window - 1`: the scheduler keeps the difference
(`window_slack`) in the sliding groups' tables, and the pools' budget counts it. A sequence
drafts only while its kept hidden state is that of position num_computed - 1 (`can_draft`):
after a disaggregated import, say, it decodes without drafting until a step of its own
computed one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvabi.cache.block_groups import GroupPlan
from kvabi.engine.paged_attention import LayerKV, SeqSlice
from kvabi.engine.scheduler import ScheduledBatch, ScheduledSeq
from kvabi.engine.sequence import Sequence
from kvabi.models.gemma4_assistant import Gemma4Assistant, SharedKV, feeding_layers
from kvabi.models.gemma4_config import Gemma4Config


def window_slack(assistant: Gemma4Assistant, target: Gemma4Config, plan: GroupPlan) -> int:
    """Keys a sliding group must keep before the target's window at P (window - 1 of them) so
    that each sliding feeding layer's group holds the window + 1 the assistant reads."""
    slack = 0
    for kind, layer_id in feeding_layers(target).items():
        need = assistant.window(kind) if kind in assistant.layer_types else 0
        window = plan.groups[plan.layer_slots[layer_id][0]].window
        if need and window:
            slack = max(slack, need - (window - 1))
    return slack


class AssistantDrafting:
    def __init__(self, assistant: Gemma4Assistant, target: torch.nn.Module, kv: LayerKV) -> None:
        self.assistant, self.target, self.kv = assistant, target, kv
        feeding = feeding_layers(target.config)
        self.feeding = {kind: feeding[kind] for kind in dict.fromkeys(assistant.layer_types)}

    @staticmethod
    def can_draft(seq: Sequence) -> bool:
        return seq.spec_hidden is not None and seq.spec_hidden_at == seq.num_computed - 1

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch with each speculating sequence's placeholder draft replaced by the
        assistant's tokens (as many as it has slots)."""
        spec = [s for s in batch.seqs if s.draft]
        tokens = torch.tensor([s.seq.token_slice(s.start, s.start + 1)[0] for s in spec])
        hidden = torch.stack([s.seq.spec_hidden for s in spec])  # type: ignore[misc]
        positions = torch.tensor([s.start for s in spec])
        shared = {kind: self._shared(spec, kind, layer) for kind, layer in self.feeding.items()}
        embed = self.target.embed_tokens
        rounds = max(len(s.draft) for s in spec)
        drafts = self.assistant.draft(embed, tokens, hidden, positions, shared, rounds).tolist()
        filled = iter(drafts)
        seqs = tuple(
            replace(s, draft=tuple(next(filled)[: len(s.draft)])) if s.draft else s
            for s in batch.seqs
        )
        return replace(batch, seqs=seqs)

    def _shared(self, spec: list[ScheduledSeq], kind: str, layer_id: int) -> SharedKV:
        """The feeding layer's keys and values before each sequence's P, padded to a batch
        (a sliding type: only the last `assistant.window` of them)."""
        window, bs = self.assistant.window(kind), self.kv.block_size
        group, rows = self.kv.group_ids[layer_id], []
        for s in spec:
            first = max(s.start - window, 0) // bs if window else 0
            table = torch.tensor(s.seq.block_tables[group][first:], dtype=torch.long)
            if (table < 0).any():  # a released block: the scheduler's slack fell short
                raise RuntimeError(f"assistant: layer {layer_id}'s keys before {s.start} freed")
            k, v = self.kv.gather(layer_id, SeqSlice(0, 0, s.start, table, first * bs))
            start = max(s.start - window, 0) - first * bs if window else 0
            rows.append((k[start:], v[start:]))
        width = max(len(k) for k, _ in rows)
        keys = rows[0][0].new_zeros(len(rows), width, *rows[0][0].shape[1:])
        values = rows[0][1].new_zeros(len(rows), width, *rows[0][1].shape[1:])
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (k, v) in enumerate(rows):
            keys[b, : len(k)], values[b, : len(v)], valid[b, : len(k)] = k, v, True
        return SharedKV(keys, values, valid)
