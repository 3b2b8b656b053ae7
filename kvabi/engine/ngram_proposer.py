"""`NgramProposer`: draft tokens by prompt lookup, with vLLM's n-gram semantics.

The draft continues the longest suffix n-gram of the sequence (n from `max_n` down to `min_n`)
that also occurs earlier, at its earliest occurrence that ends before the last token: the k
tokens that followed that occurrence, fewer where the sequence or `max_model_len` ends first.
This is what vLLM 0.32's `NgramProposer` proposes (its KMP over the reversed tokens), checked
against vLLM's own function in tests/engine/test_ngram_proposer.py. No match: no draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    k: int  # draft tokens at most
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n or self.k < 1:
            raise ValueError(
                f"ngram: need 1 <= min <= max and k >= 1, got min={self.min_n}, "
                f"max={self.max_n}, k={self.k}"
            )

    def propose(
        self, token_ids: Sequence[int], max_model_len: int, k: int | None = None
    ) -> list[int]:
        """Up to `k` (default: this proposer's) draft tokens to follow `token_ids`."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        k = min(self.k if k is None else k, max_model_len - total)
        if total < self.min_n or k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[: total - 1], n)  # occurrences ending <= T-2
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start : start + min(k, total - start)].tolist()
        return []
