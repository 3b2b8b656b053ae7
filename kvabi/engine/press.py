"""KV presses: token eviction at prefill, as NVIDIA kvpress 0.5.5 does it (its `ScorerPress`).

A request with `SamplingParams.press` has the first `len(prompt) - question` tokens of its
prompt (the context) prefilled with the full cache; then every attention layer keeps, per KV
head, `n_kept = max(1, int(context * (1 - ratio)))` of the context's tokens: those its press
scores highest (`scores.topk(n_kept)`, kvpress's order). The kept keys and values are moved to
the sequence's first slots, its other blocks freed; the rest of the prompt (the question) and
the output go on over the kept tokens at their own positions (RoPE is applied before K is
stored, so a kept key keeps its position). A pressed sequence's blocks hold chosen tokens, not
a prefix: it neither hits the prefix cache nor publishes to it.

Presses (`PressConfig.parse`: `"snapkv:ratio=0.5,window=64,kernel=5,question=24"`):
- `streaming` (StreamingLLM): the first `sinks` tokens and the most recent ones;
- `snapkv` (SnapKV): the attention of the context's last `window` queries over the tokens
  before them, averaged over those queries, smoothed by a `kernel`-wide average pool and
  averaged over each KV head's query heads; the window itself always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvabi.cache.kv_storage import KVStorage
    from kvabi.engine.scheduler import ScheduledBatch
    from kvabi.engine.sequence import Sequence

METHODS = ("streaming", "snapkv")
_FIELDS = {"ratio": float, "sinks": int, "window": int, "kernel": int, "question": int}


@dataclass(frozen=True)
class PressConfig:
    method: str
    ratio: float  # fraction of the context's tokens evicted: 0.5 is 2x, 0.875 is 8x
    sinks: int = 4  # streaming: tokens always kept at the start
    window: int = 64  # snapkv: observation window (the context's last queries)
    kernel: int = 5  # snapkv: average-pool width
    question: int = 0  # the prompt's last tokens, prefilled after the press

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"press: method {self.method!r} is not one of {METHODS}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"press: ratio must be in [0, 1), got {self.ratio}")
        if min(self.sinks, self.question) < 0 or min(self.window, self.kernel) < 1:
            raise ValueError(f"press: sinks, question >= 0 and window, kernel >= 1: {self}")

    @classmethod
    def parse(cls, text: str) -> PressConfig:
        """`method:key=value,...` (keys: ratio, sinks, window, kernel, question)."""
        method, _, rest = text.partition(":")
        values: dict[str, object] = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in _FIELDS:
                raise ValueError(f"press: unknown option {key!r} in {text!r}")
            try:
                values[key] = _FIELDS[key](value)
            except ValueError as exc:
                raise ValueError(f"press: {key}={value!r} in {text!r}: {exc}") from exc
        if "ratio" not in values:
            raise ValueError(f"press: {text!r} needs ratio=")
        return cls(method, **values)  # type: ignore[arg-type]

    def context_len(self, num_prompt: int) -> int:
        """Tokens of a prompt of `num_prompt` the press acts on (checked long enough)."""
        n = num_prompt - self.question
        least = self.window + 1 if self.method == "snapkv" else self.sinks + 1
        if n < least:
            raise ValueError(
                f"press: {self.method} needs a context of at least {least} tokens; the prompt "
                f"has {num_prompt} with question={self.question}"
            )
        return n


def n_kept(num_tokens: int, ratio: float) -> int:
    """kvpress's `compute_n_kept`: at least one token."""
    return max(1, int(num_tokens * (1 - ratio)))


def streaming_scores(num_tokens: int, num_kv_heads: int, p: PressConfig) -> torch.Tensor:
    """[H_kv, L]: 1 for the sinks and the tokens after the pruned run, 0 for it."""
    pruned = num_tokens - int(num_tokens * (1 - p.ratio))
    scores = torch.ones(num_kv_heads, num_tokens)
    scores[:, p.sinks : p.sinks + pruned] = 0
    return scores


def snapkv_scores(q: torch.Tensor, keys: torch.Tensor, p: PressConfig) -> torch.Tensor:
    """[H_kv, L] from the context's last `window` queries q [W, H, D] and its keys [L, H_kv, D]
    (both post-RoPE), kvpress's arithmetic."""
    num_tokens, num_kv_heads, dim = keys.shape
    groups, w = q.shape[1] // num_kv_heads, p.window
    k = keys.repeat_interleave(groups, dim=1)  # [L, H, D], as HF's repeat_kv
    weights = torch.matmul(q.transpose(0, 1)[None], k.permute(1, 2, 0)[None]) / math.sqrt(dim)
    mask = torch.triu(torch.full_like(weights, float("-inf")), diagonal=num_tokens - w + 1)
    weights = F.softmax(weights + mask, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-w]
    scores = weights.mean(dim=-2)  # [1, H, L - W]
    scores = F.avg_pool1d(scores, kernel_size=p.kernel, padding=p.kernel // 2, stride=1)
    scores = scores.view(num_kv_heads, groups, num_tokens - w).mean(1)
    return F.pad(scores, (0, w), value=scores.max().item() + 1)


@dataclass
class PressJob:
    """One sequence's press during the step that completes its context: per layer, the kept
    tokens' indices [H_kv, n_kept] (filled by the attention as each layer runs)."""

    config: PressConfig
    context_len: int
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def choose(self, layer_id: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Pick layer `layer_id`'s kept tokens from its context keys [L, H_kv, D] and (snapkv)
        the context's last queries q [>= window, H, D]."""
        p, num_tokens = self.config, keys.shape[0]
        if p.method == "streaming":
            scores = streaming_scores(num_tokens, keys.shape[1], p)
        else:
            scores = snapkv_scores(q[-p.window :], keys, p)
        self.kept[layer_id] = scores.topk(n_kept(num_tokens, p.ratio), dim=-1).indices


def compact(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> tuple:
    """keys, values [L, H_kv, D], kept [H_kv, n] -> the kept tokens of each head [n, H_kv, D]."""
    index = kept.T[:, :, None]  # [n, H_kv, 1]
    return (
        keys.gather(0, index.expand(-1, -1, keys.shape[-1])),
        values.gather(0, index.expand(-1, -1, values.shape[-1])),
    )


def press_jobs(batch: ScheduledBatch) -> dict[int, PressJob]:
    """The batch's pressed sequences whose context this step completes, by sequence id."""
    jobs = {}
    for s in batch.seqs:
        seq, p = s.seq, s.seq.press
        if p is None or seq.is_pressed:
            continue
        context = p.context_len(len(seq.prompt_ids))
        if s.start + s.num_tokens == context:
            jobs[seq.seq_id] = PressJob(p, context)
    return jobs


def apply_press(job: PressJob, seq: Sequence, storage: KVStorage) -> None:
    """Move each layer's kept context tokens to the sequence's first slots (per head, in the
    press's order) and count the rest as pruned; the caller frees the blocks past them."""
    table = torch.tensor(seq.block_ids, dtype=torch.long)
    kept = 0
    for layer_id, index in sorted(job.kept.items()):
        keys, values = storage.gather(layer_id, table, job.context_len)  # [L, H_kv, D]
        keys, values = compact(keys, values, index)
        kept = keys.shape[0]
        slots = torch.arange(kept)
        storage.write(layer_id, table[slots // storage.block_size], slots % storage.block_size,
                      keys, values)  # fmt: skip
    seq.num_pruned, seq.is_pressed = job.context_len - kept, True
