"""What the engine hands back: vLLM-shaped `RequestOutput` with one `CompletionOutput` per n.

Each `LLMEngine.step()` returns deltas: per request that progressed, what each choice produced
since the last step (new tokens, their logprobs, newly settled text) and whether it finished, so
a step costs the same at any output length. Text is settled when no stop string can still cut
it: the last `len(stop) - 1` characters wait for the next token (and half characters wait in
the `Detokenizer`), until the choice finishes. Each finish is reported once. `OutputBuffer`
joins one request's deltas (a stream read slowly, a whole output); `OutputAccumulator` gives
each request's whole output once it finishes (`LLM.generate`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvabi.engine.sequence import Sequence, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    """One choice: the whole of it, or what is new since the last delta."""

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


def request_delta(request_id: str, seqs: list[Sequence]) -> RequestOutput:
    """What the request's choices produced since its last delta (choices with nothing new left
    out); what it hands out is marked sent."""
    deltas = [_choice_delta(s) for s in sorted(seqs, key=lambda s: s.index)]
    outputs = tuple(d for d in deltas if d is not None)
    error = next((s.error for s in seqs if s.error is not None), None)
    finished = error is not None or (
        len(seqs) == seqs[0].params.n and all(s.is_finished for s in seqs)
    )
    return RequestOutput(request_id, tuple(seqs[0].prompt_ids), outputs, finished, error)


def _choice_delta(seq: Sequence) -> CompletionOutput | None:
    if seq.is_finish_sent:
        return None
    text = seq.text
    if not seq.is_finished:
        held = max((len(stop) for stop in seq.params.stop), default=1) - 1
        text = text[: max(len(text) - held, 0)]
    start = seq.num_sent_tokens
    if not (text or seq.is_finished or len(seq.output_ids) > start):
        return None
    seq.text, seq.num_sent_tokens = seq.text[len(text) :], len(seq.output_ids)
    seq.is_finish_sent = seq.is_finished
    logprobs = tuple(seq.logprobs[start:]) if seq.params.logprobs is not None else None
    token_ids = tuple(seq.output_ids[start:])
    return CompletionOutput(seq.index, text, token_ids, logprobs, seq.finish_reason)


def _joined(deltas: list[CompletionOutput]) -> CompletionOutput:
    last, text = deltas[-1], "".join(d.text for d in deltas)
    token_ids = tuple(t for d in deltas for t in d.token_ids)
    logprobs = None if last.logprobs is None else tuple(x for d in deltas for x in d.logprobs or ())
    return CompletionOutput(last.index, text, token_ids, logprobs, last.finish_reason)


class OutputBuffer:
    """One request's deltas, joined per choice until taken: taken once at the end, that is the
    whole output; taken as they come, what came since the last take."""

    def __init__(self) -> None:
        self._choices: dict[int, list[CompletionOutput]] = {}  # index -> deltas not yet taken
        self.latest: RequestOutput | None = None  # the newest delta added

    @property
    def is_finished(self) -> bool:
        return self.latest is not None and self.latest.finished

    def add(self, delta: RequestOutput) -> None:
        self.latest = delta
        for c in delta.outputs:
            self._choices.setdefault(c.index, []).append(c)

    def take(self) -> RequestOutput:
        """The deltas added since the last take as one (choices in index order); needs one."""
        last = self.latest
        if last is None:
            raise ValueError("take: no delta was added")
        outputs = tuple(_joined(self._choices[i]) for i in sorted(self._choices))
        self._choices = {}
        return replace(last, outputs=outputs)


class OutputAccumulator:
    """Steps' deltas of many requests -> each request's whole output, once it finishes."""

    def __init__(self) -> None:
        self._buffers: dict[str, OutputBuffer] = {}

    def add(self, deltas: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Take one step's deltas; return the whole outputs of the requests they finished."""
        finished = []
        for delta in deltas:
            buffer = self._buffers.setdefault(delta.request_id, OutputBuffer())
            buffer.add(delta)
            if delta.finished:
                finished.append(self._buffers.pop(delta.request_id).take())
        return finished
