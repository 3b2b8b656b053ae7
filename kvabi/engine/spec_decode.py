"""Speculative decoding's settings, acceptance rule and counters.

`kvabi serve --speculative ngram:k=4,min=1,max=3` (or `EngineConfig(speculative=...)`): each
step, a decoding sequence whose proposer has a draft is scheduled for its last token plus the
draft, in the same batch as the others (kvabi/engine/scheduler.py); the forward gives logits
at every one of those positions and `greedy_accept` keeps the draft's longest prefix that
equals the target's argmax, plus the target's own next token. The engine then rolls the
sequence back to what was accepted (`Scheduler.trim`): rejected tokens' K/V never reach the
prefix cache, the tiers or the KV events, which only ever see blocks of accepted tokens.

Drafting backs off where it does not pay: a sequence whose draft accepted no more tokens than
it cost skips the next 1, 2, 4, ... 16 steps (`next_backoff`; more for a costly drafter), and
no sequence speculates while more than `batch` run (verification goes through the
multi-query attention path, which at larger batches costs more than the accepted tokens save
on a CPU).

A sequence that samples (temperature > 0) verifies by rejection sampling instead
(rejection_sampler.py), which keeps the target's distribution; logprobs, when asked for, are
the target's at each emitted token's position, as without speculation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvabi.engine.ngram_proposer import NgramProposer

METHODS = ("ngram", "early-exit", "assistant")
PENDING = -1  # a draft slot the runner fills in the step itself (early exit, the assistant)


class Proposer(Protocol):
    """What the scheduler asks for drafts (`NgramProposer`; tests script their own)."""

    k: int  # draft tokens a step at most

    def propose(
        self, token_ids: Sequence[int], max_model_len: int, k: int | None = None
    ) -> list[int]: ...


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    k: int = 4  # draft tokens a step at most
    min_n: int = 1
    max_n: int = 3
    max_batch: int = 4  # speculate only while this many sequences run, at most
    exit_layer: int = 0  # early-exit: the draft is the first exit_layer layers

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """`ngram`, `ngram:k=4`, `ngram:k=4,min=2,max=5,batch=8` (vLLM's
        num_speculative_tokens, prompt_lookup_min, prompt_lookup_max; the most running
        sequences at which it still speculates); `early-exit:k=4,exit=8` (the draft is the
        target's first 8 layers; transformers' assistant_early_exit); `assistant:k=4` (a
        Gemma 4 assistant drafter reading the target's cache: `EngineConfig.draft_model`)."""
        method, _, options = text.partition(":")
        if method not in METHODS:
            raise ValueError(f"speculative: method must be one of {METHODS}, got {text!r}")
        names = {"k": "k", "min": "min_n", "max": "max_n", "batch": "max_batch"}
        names["exit"] = "exit_layer"
        values: dict[str, int] = {}
        for item in filter(None, options.split(",")):
            key, eq, value = item.partition("=")
            if key not in names or not eq or not value.isdigit():
                raise ValueError(f"speculative: expected {'=, '.join(names)}=N, got {item!r}")
            values[names[key]] = int(value)
        config = cls(method, **values)
        NgramProposer(config.k, config.min_n, config.max_n)  # validates k, min and max
        if config.max_batch < 1:
            raise ValueError(f"speculative: batch must be >= 1, got {config.max_batch}")
        if (method == "early-exit") != (config.exit_layer > 0):
            raise ValueError(f"speculative: exit=N (N >= 1) is early-exit's only, got {text!r}")
        return config

    def proposer(self) -> NgramProposer | PendingDrafter:
        if self.method == "ngram":
            return NgramProposer(self.k, self.min_n, self.max_n)
        return PendingDrafter(self.k)


@dataclass(frozen=True)
class PendingDrafter:
    """The scheduler's proposer where the model drafts (early exit, the assistant): k
    placeholder slots a step, which the runner fills before verifying (early_exit.py,
    assistant_draft.py)."""

    k: int

    def propose(
        self, token_ids: Sequence[int], max_model_len: int, k: int | None = None
    ) -> list[int]:
        return [PENDING] * min(self.k if k is None else k, max_model_len - len(token_ids))


def greedy_accept(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens a greedy verification emits: the draft's longest prefix equal to the
    target's argmax at each position, then the target's token after it (len(argmax) =
    len(draft) + 1)."""
    m = 0
    while m < len(draft) and draft[m] == argmax[m]:
        m += 1
    return [*draft[:m], argmax[m]]


MAX_BACKOFF = 16  # steps a sequence waits, at most, after a draft that did not pay


def next_backoff(backoff: int, num_accepted: int, cost: float = 0.0) -> int:
    """Steps a sequence skips drafting after this verification: none where it paid, accepting
    more tokens than the draft cost (`draft_cost`); else twice the last wait (1, 2, 4, ... up
    to `backoff_cap(cost)`), so text the drafter does not predict costs few wasted
    verifications."""
    if num_accepted > cost:
        return 0
    return min(max(2 * backoff, 1), backoff_cap(cost))


def draft_cost(spec: SpecConfig, num_layers: int) -> float:
    """What a draft adds to its step, in forward passes of the target, beyond the one-token
    decode it replaces, at batch 1 (where a pass costs the same for one row as for k + 1).
    Early exit: k rounds of the first E of L layers and one pass of the rest replace one full
    pass, so (k - 1) * E / L. N-gram lookup: nothing. An assistant drafter: counted as
    nothing, being small beside its target."""
    return (spec.k - 1) * spec.exit_layer / num_layers


def backoff_cap(cost: float) -> int:
    """The longest wait: MAX_BACKOFF, or long enough that a drafter costing `cost` forward
    passes and never paying wastes about 5% of the steps (early exit at half depth, k = 3)."""
    return max(MAX_BACKOFF, math.ceil(20 * cost))


@dataclass
class SpecStats:
    num_steps: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    def flat(self) -> dict[str, float]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {
            "spec_decode_num_drafts": self.num_steps,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": rate,
        }
