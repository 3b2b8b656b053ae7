"""Fault injection for the transports, a test seam: transports whose prefill side damages or
delays what it sends, and a way to run `kvabi serve` with them.

A plan is a comma-separated list used in turn, one item per transfer: `corrupt` flips the first
payload byte of the first layer after the writer checksummed it (the receiver's check of that
section fails); `stall:S` sleeps S seconds before sending the first layer; `freeze` (NIXL)
stops the process (SIGSTOP) right after publishing the first window; `none` sends intact.

In a child process: `python -m tests.transfer.faults PLAN python -m kvabi.cli.main serve ...`
(what `ServerProcess(prefix=faulty_prefix(PLAN))` runs) serves with both transports faulty.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.nixl_server import NixlKVServer
from kvabi.transfer.nixl_transport import DEPTH, NixlTransport
from kvabi.transfer.tcp_server import TcpKVServer
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import KVServer, KVStream, StreamProvider, TransportConfig
from kvabi.wire.container_format import HEADER, SECTION_HEADER, padding


@dataclass
class Fault:
    kind: str
    seconds: float
    offset: int  # the container offset of the first layer's first payload byte

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


class FaultPlan:
    """The plan's faults, handed out one per transfer that sends any token."""

    def __init__(self, plan: str) -> None:
        self.faults = []
        for item in filter(None, plan.split(",")):
            kind, _, arg = item.partition(":")
            self.faults.append((kind, float(arg or 0)))
        self.turn = itertools.count()

    def next(self, stream: KVStream) -> Fault | None:
        if not self.faults or not stream.token_ids:
            return None
        kind, seconds = self.faults[next(self.turn) % len(self.faults)]
        head = len(stream.desc.to_json().encode()) + HEADER.size + 4 * len(stream.token_ids)
        head += 32 * len(stream.block_hashes) + 8
        return Fault(kind, seconds, head + padding(head) + SECTION_HEADER.size)


class FaultySink:
    """A TCP sink that applies a `Fault` to the bytes passing through it."""

    def __init__(self, sink: object, fault: Fault) -> None:
        self.sink, self.fault, self.pos, self.done = sink, fault, 0, False

    def write(self, data: bytes | memoryview) -> int:
        end, offset = self.pos + len(data), self.fault.offset
        if not self.done and end > offset:
            self.done = True
            if self.fault.kind == "stall":
                time.sleep(self.fault.seconds)
            elif self.fault.kind == "corrupt":
                data = bytearray(data)
                data[offset - self.pos] ^= 0xFF
        self.pos = end
        return self.sink.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sink, name)


class FaultyTcpTransport(TcpTransport):
    plan = ""  # set per process (or per subclass in a test)

    def listen(self, address: str, desc: Descriptor, provider: StreamProvider) -> KVServer:
        plan = FaultPlan(self.plan)

        class Server(TcpKVServer):
            def wrap_sink(self, sink: object, stream: KVStream) -> object:
                fault = plan.next(stream)
                return sink if fault is None else FaultySink(sink, fault)

        return Server(self.config, address, desc, provider)


class FaultyNixlTransport(NixlTransport):
    plan = ""

    def listen(self, address: str, desc: Descriptor, provider: StreamProvider) -> KVServer:
        plan = FaultPlan(self.plan)

        class Server(NixlKVServer):
            def fault_for(self, stream: KVStream) -> Fault | None:
                return plan.next(stream)

        shape = (self.slot_bytes, self.num_slots)
        return Server(self.config, address, desc, provider, shape, DEPTH)


def faulty(transport: type, plan: str) -> type:
    """A faulty transport class of this kind with this plan."""
    base = FaultyTcpTransport if issubclass(transport, TcpTransport) else FaultyNixlTransport
    return type(base.__name__, (base,), {"plan": plan})


def faulty_prefix(plan: str) -> list[str]:
    """What `ServerProcess(prefix=...)` runs `kvabi serve` under for faulty transports."""
    return [sys.executable, "-m", "tests.transfer.faults", plan]


def main(argv: list[str]) -> None:
    """`PLAN python -m kvabi.cli.main ARGS...`: run the kvabi command with faulty transports."""
    from kvabi.cli.main import main as kvabi_main
    from kvabi.disagg import settings

    plan, rest = argv[0], argv[1:]
    if rest[1:3] != ["-m", "kvabi.cli.main"]:
        raise SystemExit("usage: python -m tests.transfer.faults PLAN python -m kvabi.cli.main ...")
    for name, transport in list(settings.TRANSPORTS.items()):
        settings.TRANSPORTS[name] = faulty(transport, plan)
    sys.exit(kvabi_main(rest[3:]))


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["TransportConfig", "faulty", "faulty_prefix"]
