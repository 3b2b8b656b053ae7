"""Rejection sampling: verifying a draft when the target samples (temperature > 0).

The rule of Leviathan et al. and Chen et al. (2023), as vLLM's rejection sampler applies it.
At draft position i, p_i is the target's distribution there (temperature, top-k and top-p
applied: `sampler.target_probs`) given the accepted tokens before it, and q_i the
distribution the draft token d_i was drawn from. d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the emitted token is drawn from the
residual max(p_i - q_i, 0), normalised, and the round ends; when every draft token is
accepted, a bonus token is drawn from p_k at the position after the draft.

Each emitted token is then distributed exactly as if the target had sampled it alone: it is
d with probability min(p(d), q(d)) by acceptance, and any token x with the residual's
remaining mass max(p(x) - q(x), 0) on rejection, which sum to p(x). A proposer whose draft is
deterministic (n-gram lookup; a drafter taking its own argmax) has a one-hot q: d is accepted
with probability p(d), and the residual is p with d removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rejection_accept(
    draft: Sequence[int],
    probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a sampled verification emits: the accepted draft prefix, then one token
    from the residual or the bonus row. probs: the target's [len(draft) + 1, vocab] rows;
    draft_probs: q's [len(draft), vocab] rows, None for a deterministic (one-hot) draft."""
    for i, d in enumerate(draft):
        p = probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if float(torch.rand((), generator=generator)) * q_d < float(p[d]):
            continue  # u < p(d) / q(d), without dividing by a q(d) of 0
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp(min=0.0)
        return [*draft[:i], _draw(residual, p, generator)]
    return [*draft, _draw(probs[len(draft)], probs[len(draft)], generator)]


def _draw(weights: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator | None) -> int:
    # The residual has no mass only through rounding (p(d) read below 1 where p is one-hot
    # on d): the target's own row is then the distribution to draw from.
    if not float(weights.sum()) > 0.0:
        weights = fallback
    return int(torch.multinomial(weights, 1, generator=generator))
