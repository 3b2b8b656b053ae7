"""`RequestHandle`: one request as the event loop sees it, fed by the engine thread.

It keeps only the latest (cumulative) output and an event that says it changed, so a client that
reads slowly costs one output's memory, never a backlog of steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvabi.engine.outputs import RequestOutput
from kvabi.engine.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine failed this request (the server goes on serving the others)."""


@dataclass(frozen=True)
class Progress:
    """What one engine step did for a request, with its timing."""

    num_new_tokens: int
    ttft: float | None  # seconds from arrival, on the step of the first token
    itl: float | None  # seconds since the previous step that gave tokens


@dataclass
class RequestHandle:
    """The latest output of a request and its timing; touched on the event loop only."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)  # when it was submitted
    latest: RequestOutput | None = None
    error: str | None = None
    last_token_time: float | None = None
    num_generated: int = 0  # over all n choices
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def advance(self, out: RequestOutput, now: float) -> Progress:
        """Take a newer output (on the event loop) and say what it added."""
        self.latest = out
        total = sum(len(c.token_ids) for c in out.outputs)
        new, self.num_generated = total - self.num_generated, total
        if not new:
            return Progress(0, None, None)
        last, self.last_token_time = self.last_token_time, now
        if last is None:
            return Progress(new, now - self.arrival, None)
        return Progress(new, None, now - last)

    async def updates(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they change (coalesced), the finished one last."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.error is not None:
                raise EngineError(self.error)
            out = self.latest
            if out is not None:
                yield out
                if out.finished:
                    return
