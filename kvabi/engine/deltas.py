"""`DeltaTracker`: the engine's cumulative outputs -> what is new for each of a request's n choices.

Text that may still change is held back until it settles: a trailing replacement character (a
multi-byte character half decoded) and, while stop strings are set, the last `len(stop) - 1`
characters (the engine cuts the text at a stop string once it appears whole, so those characters
may yet be cut). Each choice's finish is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.engine.outputs import CompletionOutput, RequestOutput
from kvabi.engine.sequence import TokenLogprob


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice since the last delta."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None


class DeltaTracker:
    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens) already handed out
        self._finished: set[int] = set()

    def deltas(self, out: RequestOutput) -> list[ChoiceDelta]:
        """What each choice produced since the last call (choices with nothing new left out)."""
        found = (self._delta(c) for c in out.outputs if c.index not in self._finished)
        return [d for d in found if d is not None]

    def _delta(self, c: CompletionOutput) -> ChoiceDelta | None:
        chars, num_tokens = self._sent.get(c.index, (0, 0))
        text = c.text[chars:] if c.finish_reason else self._settled(c.text[chars:])
        if not (text or c.finish_reason or len(c.token_ids) > num_tokens):
            return None
        self._sent[c.index] = (chars + len(text), len(c.token_ids))
        if c.finish_reason:
            self._finished.add(c.index)
        logprobs = None if c.logprobs is None else c.logprobs[num_tokens:]
        return ChoiceDelta(c.index, text, c.token_ids[num_tokens:], logprobs, c.finish_reason)

    def _settled(self, tail: str) -> str:
        tail = tail.rstrip("\ufffd")
        return tail[: max(len(tail) - self._holdback, 0)]
