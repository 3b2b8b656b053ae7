"""Early-exit self-speculation (LayerSkip; transformers' `assistant_early_exit`): the draft is
the target's own first `exit_layer` layers, its final norm and its LM head.

A step in which sequences speculate runs in two phases (`ModelRunner.run` with `drafted`):
1. `draft`: k + 1 rounds of one token per speculating sequence through layers 0 .. E-1 only.
   Round i feeds the sequence's last token (i = 0) or draft token i, at position start + i,
   writes those layers' K/V into the target's own blocks (reserved by the scheduler for the
   last token and the draft) and keeps the residual stream after layer E-1; the argmax of
   `norm -> LM head` on it is draft token i + 1 (the last round only keeps the stream).
2. verification: the sequences that did not speculate run layers 0 .. E-1 as usual; then the
   whole batch runs layers E .. L-1, the speculating rows starting from the kept streams. So
   the first E layers run once per token, never twice, and the draft keeps no cache of its own.

What a draft wrote past the accepted tokens lies past `num_computed`: the trim frees its
blocks, and a later step overwrites the slots, as for any draft (spec_decode.py).
The scheduler asks the drafter (`spec_decode.PendingDrafter`) for k placeholder tokens
(`PENDING`), which phase 1 replaces; a placeholder left in a batch fails the embedding loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvabi.engine.scheduler import ScheduledBatch, ScheduledSeq


@dataclass(frozen=True)
class Drafted:
    """Phase 1's result: the batch with every draft filled, and the speculating rows'
    residual streams after the exit layer, [batch's tokens of speculating seqs, hidden] in
    batch order (each sequence's last token, then its draft)."""

    batch: ScheduledBatch
    hidden: torch.Tensor
    exit_layer: int


def draft_rounds(runner, batch: ScheduledBatch, exit_layer: int) -> Drafted:  # noqa: ANN001
    """Phase 1 (see the module docstring) over `runner`'s model and paged attention."""
    model, spec = runner.model, [s for s in batch.seqs if s.draft]
    ids = [s.seq.token_slice(s.start, s.start + 1)[0] for s in spec]
    drafts: list[list[int]] = [[] for _ in spec]
    streams: list[list[torch.Tensor]] = [[] for _ in spec]
    for i in range(max(len(s.draft) for s in spec) + 1):
        live = [j for j, s in enumerate(spec) if i <= len(s.draft)]
        one = tuple(ScheduledSeq(spec[j].seq, spec[j].start + i, 1) for j in live)
        h = runner.run_layers(one, [ids[j] for j in live], range(exit_layer))  # [live, H]
        for r, j in enumerate(live):
            streams[j].append(h[r])
        going = [r for r, j in enumerate(live) if i < len(spec[j].draft)]
        if going:
            logits = model.compute_logits(model.norm(h[going]))
            for r, token in zip(going, logits.argmax(-1).tolist(), strict=True):
                drafts[live[r]].append(token)
                ids[live[r]] = token
    filled = iter(drafts)
    seqs = tuple(replace(s, draft=tuple(next(filled))) if s.draft else s for s in batch.seqs)
    hidden = torch.stack([h for rows in streams for h in rows])
    return Drafted(replace(batch, seqs=seqs), hidden, exit_layer)
