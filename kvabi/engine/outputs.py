"""What the engine hands back: vLLM-shaped `RequestOutput` with one `CompletionOutput` per n."""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.engine.sequence import Sequence, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None  # stop, length, abort, error; None while running


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    error: str | None = None  # the request failed (sampling or a stop rule raised): why


def request_output(request_id: str, seqs: list[Sequence]) -> RequestOutput:
    outs = tuple(
        CompletionOutput(
            s.index,
            s.text,
            tuple(s.output_ids),
            tuple(s.logprobs) if s.params.logprobs is not None else None,
            s.finish_reason,
        )
        for s in sorted(seqs, key=lambda s: s.index)
    )
    error = next((s.error for s in seqs if s.error is not None), None)
    finished = error is not None or (
        len(seqs) == seqs[0].params.n and all(s.is_finished for s in seqs)
    )
    return RequestOutput(request_id, tuple(seqs[0].prompt_ids), outs, finished, error)
