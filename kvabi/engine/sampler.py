"""Token sampling: greedy, temperature, top-k, top-p, per-sequence seeded generators, logprobs."""

from __future__ import annotations

import torch

from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.sequence import TokenLogprob


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, TokenLogprob | None]:
    """One token from float32 logits [vocab]; logprobs (of the model's distribution) on request."""
    token = _choose(logits, params, generator)
    if params.logprobs is None:
        return token, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = {}
    if params.logprobs:
        values, ids = logprobs.topk(params.logprobs)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return token, TokenLogprob(token, float(logprobs[token]), top)


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.is_greedy:
        return int(logits.argmax())
    scaled = (logits - logits.max()) / params.temperature  # <= 0: finite for any temperature
    if params.top_k:
        kth = scaled.topk(min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False  # a top_p below float32's smallest value rounds to 0 here
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
