"""`Sequence`: one generated continuation's state, as the scheduler and engine see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from kvabi.engine.detokenizer import Detokenizer
from kvabi.engine.press import PressConfig
from kvabi.engine.sampling_params import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top alternatives, token id -> logprob


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival: int  # admission order: lower is older
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per block group
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    num_preemptions: int = 0
    # Output text (engine.py, outputs.py): the detokenizer's state; text decoded but not yet in
    # a delta (what a stop string may still cut stays here); what the deltas handed out.
    detokenizer: Detokenizer = field(default_factory=Detokenizer)
    text: str = ""
    num_sent_tokens: int = 0
    is_finish_sent: bool = False
    # Prefix cache (scheduler): the chained hashes of its full blocks, their root (model and
    # cache salt), how many leading blocks are indexed in the pool, whether its lookup was
    # counted (once, at first admission), whether the lower tiers were searched since it
    # last started waiting and whether a read from them is under way (it waits for it).
    block_hashes: list[bytes] = field(default_factory=list)
    hash_root: bytes | None = None
    num_cached_blocks: int = 0
    is_counted: bool = False
    is_promoted: bool = False
    is_loading: bool = False
    # Speculative decoding (spec_decode.py): steps left without drafting, and the last wait.
    spec_skip: int = 0
    spec_backoff: int = 0
    # The target's normed hidden state at position `spec_hidden_at`, kept where an assistant
    # drafts (assistant_draft.py), which it does only while that is num_computed - 1.
    spec_hidden: torch.Tensor | None = None
    spec_hidden_at: int = -1
    # Tokens whose K/V left the cache while the sequence goes on (a KV press, press.py): the
    # cache holds `num_slots` of its `num_computed` tokens; positions stay the tokens'.
    num_pruned: int = 0
    press: PressConfig | None = None  # from `params.press`
    is_pressed: bool = False  # its context was pressed (again after a preemption)

    @property
    def num_slots(self) -> int:
        """Cache slots the computed tokens take (`num_computed` less what was pruned)."""
        return self.num_computed - self.num_pruned

    @property
    def block_ids(self) -> list[int]:
        """The first block group's table (a uniform model's only one)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`token_ids()[start:stop]` without building the rest (a decode step reads one)."""
        n = len(self.prompt_ids)
        return [
            *self.prompt_ids[start:stop],
            *self.output_ids[max(start - n, 0) : max(stop - n, 0)],
        ]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
