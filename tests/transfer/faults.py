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
import socket
import sys
import time
from dataclasses import dataclass

from kvabi.abi.descriptor import Descriptor
from kvabi.transfer.framing import ChunkedSink
from kvabi.transfer.nixl_server import NixlKVServer
from kvabi.transfer.nixl_transport import DEPTH, NixlTransport
from kvabi.transfer.nixl_windows import WindowSink
from kvabi.transfer.tcp_transport import TcpKVServer, TcpTransport
from kvabi.transfer.transport import KVServer, KVStream, StreamProvider
from kvabi.wire.container_format import HEADER, SECTION_HEADER, padding


@dataclass
class Fault:
    kind: str
    seconds: float
    offset: int  # the container offset of the first layer's first payload byte

    def corrupt(self, data: bytes | memoryview, pos: int) -> bytes | memoryview:
        """`data`, the container's bytes from `pos`, with the fault's byte flipped if there."""
        if self.kind != "corrupt" or not pos <= self.offset < pos + len(data):
            return data
        damaged = bytearray(data)
        damaged[self.offset - pos] ^= 0xFF
        return damaged


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
    """A TCP sink that stalls before, or damages, the first layer's first payload byte."""

    def __init__(self, sink: ChunkedSink, fault: Fault) -> None:
        self.sink, self.fault, self.pos = sink, fault, 0

    def write(self, data: bytes | memoryview) -> int:
        if self.fault.kind == "stall" and self.pos <= self.fault.offset < self.pos + len(data):
            time.sleep(self.fault.seconds)
        self.sink.write(self.fault.corrupt(data, self.pos))
        self.pos += len(data)
        return len(data)

    def flush(self) -> None:
        self.sink.flush()


class FaultyWindowSink(WindowSink):
    """NIXL windows: the fault's byte damaged as it is staged; `stall` sleeps before the
    first window is published, `freeze` stops the process (SIGSTOP) right after it."""

    def __init__(self, fault: Fault, *args: object) -> None:
        super().__init__(*args)
        self.fault = fault

    def write(self, data: bytes | memoryview) -> int:
        return super().write(self.fault.corrupt(data, self.pos))

    def _publish(self) -> None:
        first = self.num_windows == 0
        if first and self.fault.kind == "stall":
            time.sleep(self.fault.seconds)
        super()._publish()
        if first and self.fault.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)


class FaultyTcpTransport(TcpTransport):
    plan = ""  # set per subclass (`faulty`)

    def listen(
        self, address: str, desc: Descriptor, provider: StreamProvider, pool: object = None
    ) -> KVServer:
        plan = FaultPlan(self.plan)

        class Server(TcpKVServer):
            def _sink(self, conn: socket.socket, stream: KVStream) -> ChunkedSink:
                sink, fault = super()._sink(conn, stream), plan.next(stream)
                return sink if fault is None else FaultySink(sink, fault)

        return Server(self.config, address, desc, provider)


class FaultyNixlTransport(NixlTransport):
    plan = ""

    def listen(
        self, address: str, desc: Descriptor, provider: StreamProvider, pool: object = None
    ) -> KVServer:
        plan = FaultPlan(self.plan)

        class Server(NixlKVServer):
            def _sink(self, conn: socket.socket, slots: list[int], stream: KVStream) -> WindowSink:
                fault = plan.next(stream)
                if fault is None:
                    return super()._sink(conn, slots, stream)
                deadline = self.config.transfer_timeout_s
                return FaultyWindowSink(fault, conn, self.arena, slots, deadline)

        shape = (self.slot_bytes, self.num_slots)
        return Server(self.config, address, desc, provider, shape, DEPTH, pool)


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
