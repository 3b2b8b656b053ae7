"""One bounded NIXL READ from a peer's registered regions into ours, under a deadline.

A READ posts once and is polled: a few tight polls (loopback transfers finish in microseconds
to milliseconds), then short sleeps so the UCX progress threads get the CPU. A peer that stalls
or dies shows as `PROC` forever (or `ERR`): past the deadline the request is released (UCX
cancels it) and a `TransferTimeoutError` raised. If even the release fails, the local region
may still be written later: the caller must not reuse it (`NixlReadAbandoned`).
"""

from __future__ import annotations

import time
from typing import Any

from kvabi.transfer.errors import TransferError, TransferTimeoutError

SPIN_POLLS = 200  # polls before the first sleep
POLL_SLEEP_S = 50e-6


class NixlReadAbandoned(TransferTimeoutError):
    """A READ timed out and could not be cancelled: its local region is lost to reuse."""


def nixl_read(
    agent: Any,  # noqa: ANN401 - a nixl_agent
    peer: str,
    local_addr: int,
    remote_addr: int,
    num_bytes: int,
    timeout_s: float,
) -> None:
    """Copy `num_bytes` from `remote_addr` at agent `peer` to `local_addr`, or raise."""
    nixl_read_extents(agent, peer, [(local_addr, remote_addr, num_bytes)], timeout_s)


def nixl_read_extents(
    agent: Any,  # noqa: ANN401 - a nixl_agent
    peer: str,
    extents: list[tuple[int, int, int]],  # (local address, remote address, bytes)
    timeout_s: float,
) -> None:
    """Copy every extent from agent `peer`'s memory into ours as one transfer, or raise."""
    num_bytes = sum(n for _, _, n in extents)
    local = agent.get_xfer_descs([(a, n, 0) for a, _, n in extents], "DRAM")
    remote = agent.get_xfer_descs([(b, n, 0) for _, b, n in extents], "DRAM")
    try:
        handle = agent.initialize_xfer("READ", local, remote, peer)
    except Exception as exc:  # nixl raises its own types for a bad region or a gone peer
        raise TransferError(f"nixl READ of {num_bytes} bytes refused: {exc}") from exc
    try:
        state = _wait(agent, handle, agent.transfer(handle), time.monotonic() + timeout_s)
    except BaseException:
        _release(agent, handle, is_done=False)
        raise
    _release(agent, handle, is_done=True)
    if state != "DONE":
        raise TransferError(f"nixl READ of {num_bytes} bytes from {peer} failed ({state})")


def _wait(agent: Any, handle: Any, state: str, deadline: float) -> str:  # noqa: ANN401
    polls = 0
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TransferTimeoutError("nixl READ: the peer stalled past the timeout")
        polls += 1
        if polls > SPIN_POLLS:
            time.sleep(POLL_SLEEP_S)
        state = agent.check_xfer_state(handle)
    return state


def _release(agent: Any, handle: Any, is_done: bool) -> None:  # noqa: ANN401
    try:
        agent.release_xfer_handle(handle)
    except Exception as exc:
        if not is_done:
            raise NixlReadAbandoned(f"nixl READ timed out and cannot be cancelled: {exc}") from exc
        raise TransferError(f"nixl: releasing a finished READ failed: {exc}") from exc
