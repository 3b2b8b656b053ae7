"""`PeerBackoff`: a decode instance stops asking a prefill peer that keeps failing, for a while.

After `max_failures` failed fetches in a row a peer is skipped (the request is prefilled
locally at once) for `cooldown_s`; the first fetch after that is a probe. A probe that fails
skips the peer again for twice as long (at most `MAX_COOLDOWN_FACTOR` times `cooldown_s`); any
success forgets its failures. Pure bookkeeping over addresses; thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

MAX_COOLDOWN_FACTOR = 16


@dataclass
class _State:
    num_failures: int = 0  # in a row
    factor: int = 1  # the next cooldown's multiple of cooldown_s
    skip_until: float = 0.0


class PeerBackoff:
    def __init__(self, max_failures: int = 3, cooldown_s: float = 30.0) -> None:
        if max_failures < 1 or cooldown_s < 0:
            raise ValueError("peer backoff: max_failures >= 1 and cooldown_s >= 0")
        self.max_failures, self.cooldown_s = max_failures, cooldown_s
        self._peers: dict[str, _State] = {}
        self._lock = threading.Lock()

    def is_skipped(self, address: str) -> bool:
        """Whether fetches from this peer are skipped right now."""
        with self._lock:
            state = self._peers.get(address)
            return state is not None and time.monotonic() < state.skip_until

    def failed(self, address: str) -> None:
        """A fetch from the peer failed (timeout, closed, unreachable, bad bytes)."""
        with self._lock:
            state = self._peers.setdefault(address, _State())
            state.num_failures += 1
            if state.num_failures >= self.max_failures:
                state.skip_until = time.monotonic() + self.cooldown_s * state.factor
                state.factor = min(state.factor * 2, MAX_COOLDOWN_FACTOR)
                state.num_failures = self.max_failures - 1  # a failed probe skips again

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._peers.pop(address, None)
