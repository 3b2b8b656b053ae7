"""`AsyncEngine`: one thread owns the `LLMEngine`; asyncio handlers talk to it through queues.

The engine is not thread safe, so only its thread touches it. Handlers (on the event loop) put
commands in an inbox (`add`, `abort`); the engine thread drains it, steps while there is work and
hands each step's outputs back to the requests' `RequestHandle`s with
`loop.call_soon_threadsafe`. After every step the thread publishes an `EngineSnapshot` (blocks,
queues, cache statistics) that /metrics reads without touching the engine.

Memory: when it goes idle the thread trims the C heap (`HeapTrim`, at most every 10 s).

Progress: the thread notes when the engine last computed a token (or had nothing to do);
`seconds_without_progress` is how long an engine with work has gone without, whether its
thread is stuck in a step or its steps schedule nothing. /health reports such an engine.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvabi.engine.engine import LLMEngine
from kvabi.engine.outputs import RequestOutput
from kvabi.engine.request_handle import EngineError, Progress, RequestHandle
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.tp_group import TPError

log = logging.getLogger("kvabi.server")
_STOP = object()


class OverloadedError(RuntimeError):
    """More requests in flight than the server accepts; the client should retry later."""


@dataclass(frozen=True)
class EngineSnapshot:
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    cache_stats: dict[str, float]
    has_work: bool = False
    cache_tags: tuple[str, ...] = ()  # request tags whose figures are in cache_stats
    spec_stats: dict[str, float] = field(default_factory=dict)  # with speculative decoding


class RequestObserver(Protocol):
    """Told, on the event loop, of each request's progress (the server's metrics)."""

    def admitted(self, handle: RequestHandle) -> None: ...

    def updated(self, handle: RequestHandle, progress: Progress) -> None: ...

    def ended(self, handle: RequestHandle, outcome: str) -> None:
        """outcome: finished, aborted or failed."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, max_in_flight: int, observer: RequestObserver | None = None
    ) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.observer = observer
        self.snapshot = self._snapshot()
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # touched on the event loop only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._progress_at = time.monotonic()  # last token computed, or last idle moment
        self._trim = HeapTrim()

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def seconds_without_progress(self) -> float:
        """How long the engine has had work without computing a token (0 when it has none)."""
        if not self.snapshot.has_work:
            return 0.0
        return time.monotonic() - self._progress_at

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the results."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvabi-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread (requests still in flight fail) and close the engine."""
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None
        self._fail_all("the server is shutting down")
        self.engine.close()  # lower KV tiers finish their write-downs

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a checked prompt; raises OverloadedError past `max_in_flight` requests."""
        if not self.is_alive:
            raise EngineError("the engine is not running")
        if len(self._handles) >= self.max_in_flight:
            raise OverloadedError(f"{len(self._handles)} requests in flight")
        handle = RequestHandle(f"req-{next(self._ids)}", prompt_ids, params)
        self._handles[handle.request_id] = handle
        self._inbox.put(("add", handle.request_id, prompt_ids, params))
        if self.observer is not None:
            self.observer.admitted(handle)
        return handle

    def abort(self, handle: RequestHandle) -> bool:
        """Abort a request that has not finished (its blocks are freed); True if it was running."""
        if self._handles.pop(handle.request_id, None) is None:
            return False
        self._inbox.put(("abort", handle.request_id))
        self._ended(handle, "aborted")
        return True

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future[Any]:
        """Run `fn(engine)` on the engine thread between steps; await its result (or error)."""
        if not self.is_alive or self._loop is None:
            raise EngineError("the engine is not running")
        future = self._loop.create_future()
        self._inbox.put(("call", future, fn))
        return future

    # --- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self.snapshot = self._snapshot()
                    self._trim.maybe()  # idle: hand freed heap back to the OS
        except BaseException:
            log.exception("the engine thread died; /health reports it")
            raise
        finally:
            self._call_soon(self._fail_all, "the engine stopped")

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
            if block:
                self._progress_at = time.monotonic()  # it was idle until now: nothing owed
            while True:
                if command is _STOP:
                    return False
                self._apply(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, command: object) -> None:
        kind, request_id, *args = command  # type: ignore[misc]
        if kind == "abort":
            self.engine.abort(request_id)
            return
        if kind == "call":
            self._call(request_id, args[0])
            return
        try:
            self.engine.add_request(*args, request_id=request_id)
        except Exception as exc:  # checked before submit: a ValueError here is a race or a bug
            log.exception("add_request(%s) failed", request_id)
            self._call_soon(self._fail, request_id, f"engine refused the request: {exc}")

    def _call(self, future: asyncio.Future[Any], fn: Callable[[LLMEngine], Any]) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:
            self._call_soon(_settle, future, None, exc)
            return
        self._call_soon(_settle, future, result, None)

    def _step(self) -> None:
        """One engine step; the snapshot is published before the outputs, so a client that has
        its answer sees gauges at least as new as it."""
        before = self.engine.num_computed_tokens
        try:
            outputs = self.engine.step()
            if self.engine.num_computed_tokens != before:
                self._progress_at = time.monotonic()
        except Exception as exc:  # a bug or a bad state: fail what is in flight, keep serving
            log.exception("engine step failed; failing the requests in flight")
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
                self._call_soon(self._fail, request_id, f"engine error: {exc}")
            if isinstance(exc, TPError):  # a rank is gone: no step can run, stop (/health 503)
                raise
            outputs = []
        now = time.perf_counter()
        self.snapshot = self._snapshot()
        if outputs:
            self._call_soon(self._dispatch, outputs, now)

    def _snapshot(self) -> EngineSnapshot:
        stats = getattr(self.engine, "cache_stats", None)  # a test engine may go without
        scheduler = self.engine.scheduler
        return EngineSnapshot(
            num_blocks=self.engine.cache.num_blocks,
            num_free_blocks=self.engine.cache.num_free_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            cache_stats=dict(stats()) if callable(stats) else {},
            has_work=self.engine.has_unfinished(),
            cache_tags=self.engine.cache_tags(),
            spec_stats=_spec_stats(self.engine),
        )

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # --- back on the event loop ----------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue  # aborted meanwhile
            if out.error is not None:
                self._fail(out.request_id, f"engine error: {out.error}")
                continue
            progress = handle.advance(out, now)
            if self.observer is not None:
                self.observer.updated(handle, progress)
            if out.finished:
                del self._handles[out.request_id]
                self._ended(handle, "finished")
            handle.changed.set()

    def _fail(self, request_id: str, message: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.error = message
            self._ended(handle, "failed")
            handle.changed.set()

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._handles):
            self._fail(request_id, message)

    def _ended(self, handle: RequestHandle, outcome: str) -> None:
        if self.observer is not None:
            self.observer.ended(handle, outcome)


class HeapTrim:
    """glibc's `malloc_trim(0)`, at most every `interval_s`: freed chunks that malloc's arenas
    keep (per-step tensors of many sizes, on several threads) go back to the OS, so RSS tracks
    what is in use. A no-op where libc has no malloc_trim."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s, self._last = interval_s, 0.0
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def maybe(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.interval_s:
            self._last = now
            self._trim(0)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return  # the awaiting handler was cancelled
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _spec_stats(engine: object) -> dict[str, float]:
    """Speculative decoding's counters, when the engine speculates (spec_decode.py)."""
    config = getattr(engine, "config", None)
    if getattr(config, "speculative", None) is None:
        return {}
    return engine.spec_stats.flat()  # type: ignore[attr-defined]
