"""Test hook of the `nixl` transport's prefill side: faults injected into staged windows.

Set `KVABI_DISAGG_FAULT` (the TCP transport's variable) to a comma-separated list used in
turn, one item per transfer: `corrupt` flips the first payload byte of the first layer in the
registered slot after the writer checksummed it, so the receiver's check of that section
fails; `stall:S` sleeps S seconds before publishing the first window; `freeze` stops the
process (SIGSTOP) right after publishing the first window, a peer that hangs mid-transfer;
`none` sends intact.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np

from kvabi.abi.descriptor import Descriptor
from kvabi.wire.container_format import HEADER, SECTION_HEADER, padding

FAULT_ENV = "KVABI_DISAGG_FAULT"


class FaultPlan:
    """The faults of the variable, handed out one per transfer."""

    def __init__(self, faults: list[tuple[str, float]]) -> None:
        self.faults, self.turn = faults, itertools.count()

    @classmethod
    def from_env(cls) -> FaultPlan:
        faults = []
        for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
            kind, _, arg = item.partition(":")
            faults.append((kind, float(arg or 0)))
        return cls(faults)

    def next(self, desc: Descriptor, num_tokens: int, num_hashes: int) -> Fault | None:
        """The next transfer's fault (None without any, or for an empty container)."""
        if not self.faults or num_tokens == 0:
            return None
        kind, seconds = self.faults[next(self.turn) % len(self.faults)]
        return Fault(kind, seconds, first_payload_byte(desc, num_tokens, num_hashes))


class Fault:
    def __init__(self, kind: str, seconds: float, offset: int) -> None:
        self.kind, self.seconds, self.offset = kind, seconds, offset

    def on_staged(self, slot: np.ndarray, fill: int, pos: int, n: int) -> None:
        """`n` bytes of the container from `pos` were just copied to `slot[fill:]`."""
        if self.kind == "corrupt" and pos <= self.offset < pos + n:
            slot[fill + self.offset - pos] ^= 0xFF

    def before_publish(self, window: int) -> None:
        if self.kind == "stall" and window == 0:
            time.sleep(self.seconds)

    def after_publish(self, window: int) -> None:
        if self.kind == "freeze" and window == 0:
            os.kill(os.getpid(), signal.SIGSTOP)


def first_payload_byte(desc: Descriptor, num_tokens: int, num_hashes: int) -> int:
    """The container offset of the first layer's first payload byte (docs/ABI.md, section 5)."""
    head = len(desc.to_json().encode()) + HEADER.size + 4 * num_tokens + 32 * num_hashes + 8
    return head + padding(head) + SECTION_HEADER.size
