"""`RequestHandle`: one request as the event loop sees it, fed by the engine thread.

It joins the engine's deltas in one `OutputBuffer` and sets an event when it changed, so a
client that reads slowly costs the output's memory, never a backlog of steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvabi.engine.outputs import OutputBuffer, RequestOutput
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
    """A request's output so far and its timing; touched on the event loop only."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)  # when it was submitted
    buffer: OutputBuffer = field(default_factory=OutputBuffer)  # deltas not yet taken
    error: str | None = None
    last_token_time: float | None = None
    num_generated: int = 0  # over all n choices
    finish_reasons: list[str] = field(default_factory=list)  # one per choice, as they finish
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def advance(self, delta: RequestOutput, now: float) -> Progress:
        """Take an engine delta (on the event loop) and say what it added."""
        self.buffer.add(delta)
        new = sum(len(c.token_ids) for c in delta.outputs)
        self.num_generated += new
        self.finish_reasons += [c.finish_reason for c in delta.outputs if c.finish_reason]
        if not new:
            return Progress(0, None, None)
        last, self.last_token_time = self.last_token_time, now
        if last is None:
            return Progress(new, now - self.arrival, None)
        return Progress(new, None, now - last)

    async def updates(self) -> AsyncIterator[RequestOutput]:
        """What the request produced since the last update (deltas that came meanwhile
        joined), the finished one last."""
        while True:
            await self._changed()
            if self.buffer.latest is not None:
                out = self.buffer.take()
                yield out
                if out.finished:
                    return

    async def final(self) -> RequestOutput:
        """The whole output, once the request finished (for a handle never read by updates)."""
        while not self.buffer.is_finished:
            await self._changed()
        return self.buffer.take()

    async def _changed(self) -> None:
        await self.changed.wait()
        self.changed.clear()
        if self.error is not None:
            raise EngineError(self.error)
