"""NIXL agents and their registered memory, for the `nixl` transport.

`nixl` (`pip install 'kvabi[nixl]'`) is imported only when a NIXL transport is made: without
it, the rest of kvabi, and the TCP transport, work unchanged. An `Arena` is one DRAM region
registered with an agent once, when the transport starts, and cut into equal slots that
transfers borrow and give back: no registration per request, and one NIXL descriptor per slot
(a large region), never one per block.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.errors import TransferError, TransferTimeoutError
from kvabi.transfer.pool_regions import PoolRegion, pool_regions

log = logging.getLogger("kvabi.disagg")
INSTALL_HINT = "pip install 'kvabi[nixl]' (nixl==1.5.1; keep torch==2.13.0: install it first)"


class NixlUnavailableError(TransferError, ImportError):
    """The `nixl` transport was selected but the `nixl` package cannot be imported."""


def load_nixl() -> ModuleType:
    """`nixl._api`, or a `NixlUnavailableError` that says how to install it."""
    try:
        api = importlib.import_module("nixl._api")
    except ImportError as exc:
        raise NixlUnavailableError(
            f"the nixl transport needs nixl: {INSTALL_HINT} ({exc})"
        ) from exc
    if "NIXL_LOG_LEVEL" not in os.environ:  # nixl logs INFO lines to stdout by default
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


def is_nixl_available() -> bool:
    """Whether `load_nixl()` would succeed."""
    try:
        load_nixl()
    except NixlUnavailableError:
        return False
    return True


PROGRESS_DELAY_US = 200  # the progress thread's sleep between passes over the backends


def make_agent(role: str) -> Any:  # noqa: ANN401 - a nixl_agent; nixl ships no stubs we import
    """A NIXL agent with the UCX backend, a progress thread (a READ's target needs it) and
    locking, since transport threads share it. Its name is unique per process and object.

    nixl's Python wrapper (1.5.1) gives the progress thread no sleep between passes: it spins,
    and an idle process with an agent burns a whole core (measured: 3.0 CPU-s in 3 s idle, and
    every other process on this 2-core machine ran slower). The agent is made with
    PROGRESS_DELAY_US instead (0.06 CPU-s in 3 s idle)."""
    api = load_nixl()
    conf = api.nixl_agent_config(
        enable_prog_thread=True,
        backends=["UCX"],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    name = f"kvabi-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    wrapper = importlib.import_module(api.nixl_agent.__module__)
    bind = getattr(wrapper, "nixlBind", None)
    if bind is None:  # another nixl layout: its own default
        log.warning("nixl: cannot set the progress thread's delay; it may spin")
        return api.nixl_agent(name, conf)
    with _AGENT_LOCK:
        wrapper.nixlBind = _DelayedBind(bind)
        try:
            return api.nixl_agent(name, conf)
        finally:
            wrapper.nixlBind = bind


_AGENT_LOCK = threading.Lock()


class _DelayedBind:
    """nixl's binding module, except that the agent configs it makes keep PROGRESS_DELAY_US
    when the wrapper sets their `pthrDelay` to 0."""

    def __init__(self, bind: ModuleType) -> None:
        class Config(bind.nixlAgentConfig):  # type: ignore[name-defined, misc]
            def __setattr__(self, key: str, value: object) -> None:
                if key == "pthrDelay" and value == 0:
                    value = PROGRESS_DELAY_US
                super().__setattr__(key, value)

        self._bind, self.nixlAgentConfig = bind, Config

    def __getattr__(self, name: str) -> object:
        return getattr(self._bind, name)


@dataclass(frozen=True)
class ArenaInfo:
    """What a peer needs to READ an arena's slots: the agent, the base address, the slots."""

    agent_name: str
    base: int
    slot_bytes: int
    num_slots: int

    def to_msg(self) -> dict:
        return {
            "agent": self.agent_name,
            "base": self.base,
            "slot": self.slot_bytes,
            "n": self.num_slots,
        }

    @classmethod
    def from_msg(cls, msg: dict) -> ArenaInfo:
        fields = (msg.get("agent"), msg.get("base"), msg.get("slot"), msg.get("n"))
        if not isinstance(fields[0], str) or not all(isinstance(x, int) for x in fields[1:]):
            raise TransferError("malformed nixl arena message")
        return cls(*fields)


class Arena:
    """`num_slots` x `slot_bytes` of DRAM registered with `agent` once; slots are lent out."""

    def __init__(self, agent: Any, slot_bytes: int, num_slots: int) -> None:  # noqa: ANN401
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("arena: slot_bytes and num_slots must be > 0")
        self.agent, self.slot_bytes, self.num_slots = agent, slot_bytes, num_slots
        self.memory = torch.zeros(slot_bytes * num_slots, dtype=torch.uint8)  # [bytes], touched
        self._reg = agent.register_memory([(self.base, self.memory.numel(), 0, "")], "DRAM")
        self._free = list(range(num_slots))
        self._cond = threading.Condition()

    @property
    def base(self) -> int:
        return self.memory.data_ptr()

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.agent.name, self.base, self.slot_bytes, self.num_slots)

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a uint8 tensor view."""
        return self.memory[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def acquire(self, count: int, timeout_s: float) -> list[int]:
        """`count` free slots, taken together (so two transfers never wait on each other)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._free) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"no free nixl slot within {timeout_s:.1f} s")
                self._cond.wait(left)
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free += slots
            self._cond.notify_all()

    def close(self) -> None:
        """Deregister the memory (no transfer may be in flight)."""
        self.agent.deregister_memory(self._reg)


class PoolRegistry:
    """Block pools registered with `agent` whole, once each (by their buffers' addresses),
    so peers can READ their blocks (or READs can land in them) with no registration per
    transfer."""

    def __init__(self, agent: Any) -> None:  # noqa: ANN401
        self.agent = agent
        self._pools: dict[tuple[int, ...], tuple[list[PoolRegion], Any]] = {}
        self._lock = threading.Lock()

    def regions(self, pool: CacheBuffers) -> list[PoolRegion]:
        """`pool`'s regions (pool_regions.py), registering its buffers on first sight."""
        key = _addresses(pool)
        with self._lock:
            if key in self._pools:
                return self._pools[key][0]
            regions = pool_regions(pool)
            tensors = pool.tensors.values()
            spans = [(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors]
            self._pools[key] = (regions, self.agent.register_memory(spans, "DRAM"))
        return regions

    def close(self) -> None:
        """Deregister every pool (no transfer may be in flight)."""
        with self._lock:
            for _, registration in self._pools.values():
                self.agent.deregister_memory(registration)
            self._pools.clear()


def _addresses(pool: CacheBuffers) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in pool.tensors.values())


class StagingBuffers:
    """Registered caches of one descriptor that lent blocks of another layout land in before
    their conversion: taken per fetch (fetches run at once) and given back, each registered
    once and kept until `registry` closes (registered memory must outlive its registration).
    Sizes are powers of two blocks, so a growing prompt adds few of them."""

    def __init__(self, registry: PoolRegistry, desc: Descriptor) -> None:
        self.registry, self.desc = registry, desc
        self._free: list[CacheBuffers] = []
        self._lock = threading.Lock()

    def take(self, num_blocks: int) -> CacheBuffers:
        """Buffers of at least `num_blocks` blocks, registered."""
        with self._lock:
            fits = [b for b in self._free if b.extent >= num_blocks]
            if fits:
                self._free.remove(fits[0])
                return fits[0]
        extent = 1 << max(num_blocks - 1, 0).bit_length()
        buffers = CacheBuffers.empty(self.desc, extent, "zeros")  # touched: no faults in a READ
        self.registry.regions(buffers)
        return buffers

    def give_back(self, buffers: CacheBuffers) -> None:
        with self._lock:
            self._free.append(buffers)
