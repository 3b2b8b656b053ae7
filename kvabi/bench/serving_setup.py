"""The two deployments `kvabi bench disagg` compares, as real processes on this machine's cores.

Colocated: one `kvabi serve` on every core the bench may use, with as many torch threads.
Disaggregated: `kvabi disagg` (router + one prefill + one decode instance), the prefill instance
on the first half of those cores and the decode instance on the second half, each with torch
threads for its half. So both setups get the same cores; the split is the only difference.
Every instance uses the same KV layout and block size (nhd, 16), so no conversion is measured
here (the transfer part of the bench measures that). The router process and the load generator
are not pinned: they run wherever the OS puts them, as the load generator does colocated too.
The thread count is fixed by OMP_NUM_THREADS at start; pinning happens once the processes
answer, moving every thread (Linux `sched_setaffinity` on each task of the process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from kvabi.server.launch import ServerProcess

LAYOUT = ["--kv-layout", "nhd", "--block-size", "16"]
DISAGG_LAYOUT = ["--prefill-layout", "nhd", "--prefill-block-size", "16"]
DISAGG_LAYOUT += ["--decode-layout", "nhd", "--decode-block-size", "16"]


@dataclass(frozen=True)
class CoreSplit:
    cores: tuple[int, ...]  # what the colocated instance gets
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @classmethod
    def of(cls, cores: set[int]) -> CoreSplit:
        """Halves of `cores`; with one core, both instances share it (no split to measure)."""
        ordered = tuple(sorted(cores))
        if len(ordered) < 2:
            return cls(ordered, ordered, ordered)
        half = len(ordered) // 2
        return cls(ordered, ordered[:half], ordered[half:])

    @property
    def is_split(self) -> bool:
        return not set(self.prefill) & set(self.decode)

    def describe(self) -> str:
        """The fairness statement the bench prints and writes."""
        text = (
            f"colocated: kvabi serve on cores {list(self.cores)}, {len(self.cores)} torch "
            f"threads; disaggregated: prefill on cores {list(self.prefill)}, decode on cores "
            f"{list(self.decode)}, {self.threads_per_role} torch thread(s) each; router and "
            "load generator unpinned; same KV layout (nhd, 16-token blocks) everywhere"
        )
        return text if self.is_split else text + " (ONE core: prefill and decode share it)"

    @property
    def threads_per_role(self) -> int:
        return min(len(self.prefill), len(self.decode))


class DisaggProcess(ServerProcess):
    """`kvabi disagg ARGS` on a free port; ready once its router's /health answers 200."""

    def start(self) -> DisaggProcess:
        command = [sys.executable, "-m", "kvabi.cli.main", "disagg", "--port", str(self.port)]
        self.process = subprocess.Popen(
            command + self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        return self


def model_args(model: str | None, dtype: str) -> list[str]:
    """The model options `kvabi serve` and `kvabi disagg` share."""
    return ["--dtype", dtype] + (["--model", model] if model else [])


@contextmanager
def colocated(model: list[str], split: CoreSplit) -> Iterator[str]:
    """One `kvabi serve` on all of `split.cores`; yields its base URL (.../v1)."""
    env = _env(len(split.cores))
    with ServerProcess(["--log-level", "warning", *LAYOUT, *model], env=env) as server:
        assert server.process is not None
        pin(server.process.pid, split.cores)
        yield server.base_url


@contextmanager
def disaggregated(model: list[str], split: CoreSplit) -> Iterator[str]:
    """`kvabi disagg`, its prefill and decode instances pinned apart; yields the router's URL."""
    env = _env(split.threads_per_role)
    with DisaggProcess(["--log-level", "warning", *DISAGG_LAYOUT, *model], env=env) as router:
        assert router.process is not None
        roles = {_role(pid): pid for pid in _children(router.process.pid)}
        if set(roles) != {"prefill", "decode"}:
            raise RuntimeError(f"kvabi disagg: expected a prefill and a decode child, got {roles}")
        pin(roles["prefill"], split.prefill)
        pin(roles["decode"], split.decode)
        yield router.base_url


def pin(pid: int, cores: tuple[int, ...]) -> None:
    """Move every thread of process `pid` onto `cores` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return found


def _role(pid: int) -> str | None:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--role") + 1].decode() if b"--role" in args else None


def _env(num_threads: int) -> dict[str, str]:
    threads = str(num_threads)
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "KVABI_API_KEY": ""}
