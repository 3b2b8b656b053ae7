"""`LayerFeed`: layers handed over in order, failures and deadlines reach the consumer, and
abandoning the iterator early (only then) runs `on_abandon`."""

from __future__ import annotations

import threading

import pytest
import torch

from kvabi.transfer.errors import TransferError, TransferTimeoutError
from kvabi.transfer.layer_feed import LayerFeed


def test_layers_arrive_in_order_while_the_producer_runs():
    feed, abandoned = LayerFeed([0, 2, 3], timeout_s=5), []
    feed.on_abandon = lambda: abandoned.append(True)
    thread = threading.Thread(
        target=lambda: [feed.put(i, {"x": torch.full((1,), i)}) for i in (0, 2, 3)]
    )
    thread.start()
    got = [(i, t["x"].item()) for i, t in feed.layers()]
    thread.join()
    assert got == [(0, 0), (2, 2), (3, 3)] and feed.is_complete and abandoned == []


def test_a_failure_reaches_the_consumer_after_the_layers_before_it():
    feed = LayerFeed([0, 1], timeout_s=5)
    feed.put(0, {})
    feed.fail(TransferError("prefill aborted"))
    layers = feed.layers()
    assert next(layers) == (0, {})
    with pytest.raises(TransferError, match="prefill aborted"):
        next(layers)


def test_a_layer_out_of_order_fails_the_feed():
    feed = LayerFeed([0, 1], timeout_s=5)
    feed.put(1, {})
    assert not feed.is_complete
    with pytest.raises(TransferError, match="layer 1 stored out of order"):
        next(feed.layers())


def test_the_deadline_bounds_every_wait_and_abandoning_runs_on_abandon():
    feed, abandoned = LayerFeed([0, 1], timeout_s=0.05), []
    feed.on_abandon = lambda: abandoned.append(True)
    with pytest.raises(TransferTimeoutError):
        list(feed.layers())
    assert abandoned == [True]
    feed = LayerFeed([0, 1], timeout_s=5)
    feed.on_abandon = lambda: abandoned.append(False)
    feed.put(0, {})
    layers = feed.layers()
    next(layers)
    layers.close()  # the sender gave up after one layer
    assert abandoned == [True, False]
