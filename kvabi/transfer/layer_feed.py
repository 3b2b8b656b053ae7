"""`LayerFeed`: one prompt's layers handed from the engine thread to a transport's sender.

The engine thread `put`s each owner layer's buffers (a copy of the prompt's blocks of that
layer, taken right after the forward stored it, so later steps may reuse the blocks) while it
goes on computing the next layers; the sender thread iterates `layers()`, which waits for each
in turn. Either side can end it early: the producer with `fail` (the prefill failed or was
aborted), the consumer by closing the iterator before its end (which runs `on_abandon`, e.g.
to abort the prefill). Every wait is bounded by the deadline.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Generator

import torch

from kvabi.transfer.errors import TransferError, TransferTimeoutError

LayerBuffers = tuple[int, dict[str, torch.Tensor]]  # (layer_id, buffers keyed as the specs)


class LayerFeed:
    def __init__(self, layer_ids: list[int], timeout_s: float) -> None:
        self.layer_ids, self.deadline = layer_ids, time.monotonic() + timeout_s
        self.on_abandon: Callable[[], None] = lambda: None
        self._queue: queue.SimpleQueue[LayerBuffers | BaseException] = queue.SimpleQueue()
        self._num_put = 0

    @property
    def is_complete(self) -> bool:
        """Whether every layer was put."""
        return self._num_put == len(self.layer_ids)

    def put(self, layer_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hand over the next layer (producer side, in ascending layer order)."""
        if self.is_complete or layer_id != self.layer_ids[self._num_put]:
            self.fail(TransferError(f"layer {layer_id} stored out of order"))
            return
        self._num_put += 1
        self._queue.put((layer_id, tensors))

    def fail(self, exc: BaseException) -> None:
        """End the feed with `exc`: the consumer raises it at its next wait."""
        self._queue.put(exc)

    def layers(self) -> Generator[LayerBuffers, None, None]:
        """Each layer as it is put (consumer side); raises what `fail` was given, or
        TransferTimeoutError past the deadline."""
        is_done = False
        try:
            for _ in self.layer_ids:
                yield self._next()
            is_done = True
        finally:
            if not is_done:
                self.on_abandon()

    def _next(self) -> LayerBuffers:
        try:
            item = self._queue.get(timeout=max(self.deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise TransferTimeoutError("the prefill stored no layer before the deadline") from None
        if isinstance(item, BaseException):
            raise item
        return item
