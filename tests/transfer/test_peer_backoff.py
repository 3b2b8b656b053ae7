"""PeerBackoff: skip a peer after failures in a row, probe it after a cooldown that doubles."""

from __future__ import annotations

import time

import pytest

from kvabi.transfer.peer_backoff import PeerBackoff


def test_a_peer_is_skipped_after_failures_in_a_row_then_probed():
    b = PeerBackoff(max_failures=2, cooldown_s=0.2)
    b.failed("p")
    assert not b.is_skipped("p")
    b.succeeded("p")  # a success forgets the failure
    b.failed("p")
    assert not b.is_skipped("p")
    b.failed("p")
    assert b.is_skipped("p") and not b.is_skipped("other")
    time.sleep(0.25)
    assert not b.is_skipped("p")  # the probe
    b.failed("p")  # a failed probe skips again, twice as long
    time.sleep(0.25)
    assert b.is_skipped("p")
    time.sleep(0.2)
    assert not b.is_skipped("p")
    b.succeeded("p")
    b.failed("p")
    assert not b.is_skipped("p")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_failures >= 1"):
        PeerBackoff(max_failures=0)
