"""Pearson's chi-square goodness of fit, for the seeded statistical tests of sampling."""

from __future__ import annotations

from collections import Counter

import torch

# Each statistical test fails a correct sampler with probability 1e-4 per check (so the
# suite's dozen checks about 1e-3 in all, and never on a rerun: every draw is seeded), and
# fails the rules that break the distribution (tests/engine/test_rejection_sampler.py shows
# one) at p-values below 1e-20.
ALPHA = 1e-4


def chi_square_pvalue(draws: list[int], probs: torch.Tensor) -> float:
    """P-value of `draws` under `probs` [vocab]; 0.0 if any draw has probability 0. The
    least likely categories are pooled into one bin until it expects >= 5 draws (the
    approximation's usual condition)."""
    counts, n = Counter(draws), len(draws)
    if any(float(probs[t]) == 0.0 for t in counts):
        return 0.0
    support = sorted((probs > 0).nonzero().flatten().tolist(), key=lambda t: float(probs[t]))
    total = float(probs[support].sum())
    bins: list[tuple[float, int]] = []  # (expected, observed)
    pooled = (0.0, 0)
    for t in support:
        e, o = n * float(probs[t]) / total, counts[t]
        if pooled[0] + e < 5 or (pooled[0] and pooled[0] < 5):
            pooled = (pooled[0] + e, pooled[1] + o)
        else:
            bins.append((e, o))
    if pooled[0]:
        bins.append(pooled)
    assert len(bins) > 1 and min(e for e, _ in bins) >= 5, "too few draws for the test"
    stat = sum((o - e) ** 2 / e for e, o in bins)
    df = torch.tensor((len(bins) - 1) / 2.0)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2.0)))
