"""Rank 0's side of tensor parallelism: N - 1 worker processes (kvabi/engine/tp_worker.py)
over `torch.distributed` (gloo, TCP on 127.0.0.1), each holding its shard of the weights and
of the KV heads (kvabi/parallel/tp_plan.py, tp_shard.py).

Rank 0 runs the engine: it schedules, and before each forward broadcasts the step (the
block copies, token ids, positions and each block group's attention context: everything a
rank needs to write its K/V into the same blocks and attend over them). Every rank then
runs its shard; the attention output and MLP down projections all-reduce (through shared
memory: tp_shm.py; gloo for what does not fit); rank 0 alone
computes logits and samples. The ranks' KV caches mirror rank 0's block tables, so they
have the same number of blocks (rank 0's, which holds the most heads).

Failures never hang: each collective has the group's timeout, rank 0 checks its workers are
alive before every step, and a dead, late or disagreeing rank raises `TPError` (the caller
fails its requests). At start-up the ranks compare the model's fingerprint and the plan.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.engine.paged_attention import StepContext
from kvabi.engine.tp_shm import ShmAllReduce, ShmTimeout, shm_path


class TPError(RuntimeError):
    """A rank died, timed out or disagreed: the group can run no more steps."""


@dataclass(frozen=True)
class TPSetup:
    """Rank 0's engine config for the workers' caches (their block count is rank 0's), and
    the tag of the shared-memory all-reduce's file (tp_shm.py)."""

    config: Any  # EngineConfig
    shm_tag: str


@dataclass(frozen=True)
class TPStep:
    """What every rank needs for one forward."""

    copies: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]  # (pool, srcs, dsts)
    ids: torch.Tensor
    positions: torch.Tensor
    ctxs: tuple[StepContext, ...]


@dataclass(frozen=True)
class TPBlocks:
    """Whole blocks crossing the group's boundary: `gather` (each worker sends rank 0 its heads
    of pool `pool_id`'s blocks `block_ids`, tensor by tensor in key order) or not (rank 0 sends
    each worker its heads, which it writes there)."""

    pool_id: int
    block_ids: tuple[int, ...]
    gather: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, size: int, port: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )


def agreement(fingerprint: str, plan: Any, dtype: str) -> dict[str, Any]:
    """What every rank must hold alike."""
    return {"fingerprint": fingerprint, "plan": plan, "dtype": dtype}


class TPGroup:
    def __init__(
        self, size: int, workers: list[subprocess.Popen], threads: int, shm: ShmAllReduce, tag: str
    ) -> None:
        self.size, self.workers = size, workers
        self.shm, self.shm_tag = shm, tag
        shm.alive = lambda: not self._exited(wait_s=0.0)
        self._threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.closed = False
        self.reduce_s = self.send_s = 0.0  # rank 0's seconds in all-reduces and broadcasts
        self.move_s = 0.0  # rank 0's seconds gathering and scattering whole blocks
        self.plan: Any = None  # the TPPlan, and the whole model's KV layers (tp_engine sets)
        self.kv_layers: tuple[Any, ...] = ()
        self.num_steps = 0  # steps broadcast

    @classmethod
    def launch(
        cls, model: str, dtype: str, size: int, threads: int = 1, timeout_s: float = 60.0
    ) -> TPGroup:
        """Start ranks 1 .. size-1 and join them as rank 0 (TPError if they do not come)."""
        port = free_port()
        command = [sys.executable, "-m", "kvabi.engine.tp_worker", "--model", model]
        command += ["--dtype", dtype, "--size", str(size), "--port", str(port)]
        command += ["--threads", str(threads), "--timeout", str(timeout_s)]
        workers = [subprocess.Popen([*command, "--rank", str(r)]) for r in range(1, size)]
        try:
            shm = ShmAllReduce.create(str(port), size, timeout_s)
            init_group(0, size, port, timeout_s)
        except Exception as exc:
            for w in workers:
                w.kill()
            shm_path(str(port)).unlink(missing_ok=True)
            raise TPError(f"tp: the {size - 1} worker ranks did not join: {exc}") from exc
        return cls(size, workers, threads, shm, str(port))

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor` (in place): through shared memory where it fits,
        else gloo."""
        start = time.perf_counter()
        if self.shm.fits(tensor):
            try:
                self.shm(tensor)
            except ShmTimeout as exc:
                gone = self._exited(wait_s=1.0)
                raise TPError(f"tp: {gone or exc} during a step") from exc
        else:
            self._collective(dist.all_reduce, tensor)
        self.reduce_s += time.perf_counter() - start
        return tensor

    def setup(self, config: Any) -> None:
        """Send the workers the engine config their caches follow."""
        self.send(TPSetup(config, self.shm_tag))

    def agree(self, mine: dict[str, Any]) -> None:
        """Refuse ranks that hold another model, plan or dtype (they are told to exit)."""
        theirs: list[Any] = [None] * self.size
        self._collective(dist.all_gather_object, theirs, mine)
        for rank, other in enumerate(theirs):
            for key, value in mine.items():
                if other[key] != value:
                    self.send(("abort", f"rank {rank} disagrees on {key}"))
                    raise TPError(f"tp: rank {rank} holds another {key} than rank 0")

    def send(self, message: object) -> None:
        """Broadcast one message (a setup, a `TPStep`, or None: stop) to the workers."""
        self.check_alive()
        start = time.perf_counter()
        self._collective(dist.broadcast_object_list, [message], 0)
        self.send_s += time.perf_counter() - start
        self.num_steps += isinstance(message, TPStep)

    def gather_blocks(
        self, pool_id: int, block_ids: list[int], descs: list[Descriptor]
    ) -> list[CacheBuffers]:
        """Ranks 1 .. N-1's copies of pool `pool_id`'s blocks `block_ids` (`descs[r]`: rank
        r's cache)."""
        self.send(TPBlocks(pool_id, tuple(block_ids), gather=True))
        start = time.perf_counter()
        shards = []
        for rank in range(1, self.size):
            shard = CacheBuffers.empty(descs[rank], len(block_ids))
            for key in sorted(shard.tensors):
                self._collective(dist.recv, shard.tensors[key], rank)
            shards.append(shard)
        self.move_s += time.perf_counter() - start
        return shards

    def scatter_blocks(
        self, pool_id: int, block_ids: list[int], shards: list[CacheBuffers]
    ) -> None:
        """Have ranks 1 .. N-1 write `shards[r]` (rank r's heads) into their blocks `block_ids`."""
        self.send(TPBlocks(pool_id, tuple(block_ids), gather=False))
        start = time.perf_counter()
        for rank in range(1, self.size):
            for key in sorted(shards[rank].tensors):
                self._collective(dist.send, shards[rank].tensors[key].contiguous(), rank)
        self.move_s += time.perf_counter() - start

    def check_alive(self) -> None:
        if self.closed:
            raise TPError("tp: the group is closed")
        gone = self._exited(wait_s=0.0)
        if gone:
            raise TPError(f"tp: {gone}")

    def _collective(self, op: Any, *args: Any) -> None:
        try:
            op(*args)
        except Exception as exc:  # gloo: a peer's socket closed, or the timeout ran out
            gone = self._exited(wait_s=1.0)
            if gone:
                raise TPError(f"tp: {gone} during a step") from exc
            raise TPError(f"tp: a collective failed; a rank hung or broke: {exc}") from exc

    def _exited(self, wait_s: float) -> str:
        """The ranks that have exited (waiting up to `wait_s` for a dying one), in words."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [(r, w.poll()) for r, w in enumerate(self.workers, start=1)]
            gone = [(r, code) for r, code in gone if code is not None]
            if gone or time.monotonic() >= deadline:
                return ", ".join(f"rank {r} exited (code {code})" for r, code in gone)
            time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (kill those that do not exit) and leave the group."""
        if self.closed:
            return
        with contextlib.suppress(TPError):  # a dead group: the workers are killed below
            self.send(None)
        self.closed = True
        for w in self.workers:
            try:
                w.wait(timeout_s)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        dist.destroy_process_group()
        self.shm.close(unlink=True)
        torch.set_num_threads(self._threads)
