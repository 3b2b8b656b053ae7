"""Token sampling: greedy, temperature, top-k, top-p, per-sequence seeded generators, logprobs."""

from __future__ import annotations

import torch

from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.sequence import TokenLogprob


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, TokenLogprob | None]:
    """One token from float32 logits [vocab]; logprobs (of the model's distribution) on request."""
    if params.is_greedy:
        token = int(logits.argmax())
    else:
        token = int(torch.multinomial(target_probs(logits, params), 1, generator=generator))
    return token, token_logprob(logits, token, params)


def token_logprob(logits: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprob | None:
    """`token`'s logprob and the top `params.logprobs` alternatives under the model's own
    distribution (the raw logits [vocab], as vLLM returns them); None when not asked for."""
    if params.logprobs is None:
        return None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = {}
    if params.logprobs:
        values, ids = logprobs.topk(params.logprobs)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), top)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy sequence samples from: float32 logits [..., vocab] after
    temperature, top-k and top-p, one row per position (rejection sampling verifies against
    these rows)."""
    scaled = (logits - logits.amax(-1, keepdim=True)) / params.temperature  # <= 0: finite
    if params.top_k:
        kth = scaled.topk(min(params.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[..., 0] = False  # a top_p below float32's smallest value rounds to 0 here
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)  # rejection sampling reads p(d) itself
    return probs
