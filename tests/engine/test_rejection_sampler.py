"""Rejection sampling keeps the target's distribution: seeded chi-square tests of every
emitted position (the first token, each accepted draft's successor, the bonus token) for
one-hot and sampled drafts, and a broken rule that the same test catches."""

from __future__ import annotations

import pytest
import torch

from kvabi.engine.rejection_sampler import rejection_accept
from kvabi.engine.sampler import target_probs
from kvabi.engine.sampling_params import SamplingParams
from tests.engine.chi_square import ALPHA, chi_square_pvalue

VOCAB, K, TRIALS = 6, 3, 6000


def rows(seed: int, n: int = K + 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(1.2 * torch.randn(n, VOCAB, generator=g), dim=-1)  # [n, VOCAB]


def emitted_by_position(emits: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
    """Position i's draws among the trials that accepted the draft's first i tokens: each
    is distributed as p_i, whatever the draft was."""
    out: list[list[int]] = [[] for _ in range(K + 1)]
    for emit, draft in zip(emits, drafts, strict=True):
        assert 1 <= len(emit) <= K + 1 and emit[:-1] == draft[: len(emit) - 1]
        for i, token in enumerate(emit):
            out[i].append(token)
    return out


def check_positions(probs: torch.Tensor, by_position: list[list[int]]) -> list[float]:
    pvalues = [chi_square_pvalue(draws, probs[i]) for i, draws in enumerate(by_position)]
    assert all(len(d) >= 300 for d in by_position), [len(d) for d in by_position]
    return pvalues


def test_a_one_hot_draft_emits_the_targets_distribution_at_every_position():
    probs, gen = rows(1), torch.Generator().manual_seed(2)
    draft = [int(probs[i].argmax()) for i in range(K)]  # a likely draft: reaches the bonus
    emits = [rejection_accept(draft, probs, gen) for _ in range(TRIALS)]
    pvalues = check_positions(probs, emitted_by_position(emits, [draft] * TRIALS))
    assert min(pvalues) > ALPHA, pvalues
    accepted = sum(len(e) - 1 for e in emits) / (K * TRIALS)
    assert 0.2 < accepted < 0.9, accepted  # both branches ran often


def test_a_sampled_draft_emits_the_targets_distribution_at_every_position():
    probs, q, gen = rows(3), rows(4, K), torch.Generator().manual_seed(5)
    drafts, emits = [], []
    for _ in range(TRIALS):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(K)]
        drafts.append(draft)
        emits.append(rejection_accept(draft, probs, gen, draft_probs=q))
    pvalues = check_positions(probs, emitted_by_position(emits, drafts))
    assert min(pvalues) > ALPHA, pvalues


def test_the_check_catches_resampling_from_the_target_instead_of_the_residual():
    """The classic mistake (draw a rejected position's token from p, d included) passes
    every accepted token and skews the first one toward d: the test must see it."""
    probs, gen = rows(1), torch.Generator().manual_seed(2)
    draft = [int(probs[0].argmax())]

    def wrong(draft, probs, gen):
        if float(torch.rand((), generator=gen)) < float(probs[0, draft[0]]):
            return [draft[0], int(torch.multinomial(probs[1], 1, generator=gen))]
        return [int(torch.multinomial(probs[0], 1, generator=gen))]

    first = [wrong(draft, probs, gen)[0] for _ in range(TRIALS)]
    assert chi_square_pvalue(first, probs[0]) < 1e-20
    right = [rejection_accept(draft, probs, gen)[0] for _ in range(TRIALS)]
    assert chi_square_pvalue(right, probs[0]) > ALPHA


def test_certain_and_impossible_draft_tokens():
    gen = torch.Generator().manual_seed(0)
    sure = torch.zeros(3, VOCAB)
    sure[0, 4] = sure[1, 2] = sure[2, 1] = 1.0
    assert rejection_accept([4, 2], sure, gen) == [4, 2, 1]
    probs = rows(7, 2)
    probs[0, 3] = 0.0  # the draft token cannot be sampled: always rejected, never emitted
    firsts = {rejection_accept([3], probs, gen)[0] for _ in range(200)}
    assert 3 not in firsts and len(firsts) > 1
    q = torch.zeros(1, VOCAB)
    q[0, 0] = 1.0  # q one-hot on the draft token equals the deterministic rule
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    probs = rows(8, 2)
    for _ in range(50):
        assert rejection_accept([0], probs, g1, q) == rejection_accept([0], probs, g2)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=4, top_p=0.8),
    ],
)
def test_target_rows_are_the_samplers_distribution_row_by_row(params):
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    both = target_probs(logits, params)
    for row, probs in zip(logits, both, strict=True):
        torch.testing.assert_close(probs, target_probs(row, params), rtol=0, atol=0)
        assert abs(float(probs.sum()) - 1.0) < 1e-5
        if params.top_k:
            assert int((probs > 0).sum()) <= params.top_k
