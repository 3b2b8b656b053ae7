"""Shared bench output: timings and, on request, one JSON object (tables: kvabi/abi/table.py).

A ratio against a baseline is measured interleaved (`paired`: baseline, measurement, baseline,
...), so a slow phase of a shared host lands on both sides; the baseline's spread is reported,
and a baseline slower than the machine's plain copy (`plain_copy_gbps`, measured at the
bench's start) by more than `DISTURBED_FACTOR` makes the ratio None and the figure flagged:
another process held a core (torch's OpenMP threads wait on a descheduled one), and a ratio
over such a baseline says nothing about kvabi."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvabi.native.cpu_kernels import cpu_name

DISTURBED_FACTOR = 3.0  # a baseline this much slower than the plain copy is not trusted


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Fastest of `repeats` timed calls (after `warmup` untimed ones): robust on a noisy host."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write_json(path: str | None, figures: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        print(f"\nfigures written to {path}")


@dataclass(frozen=True)
class Paired:
    """Interleaved timings of a baseline and a measurement, `repeats` of each."""

    baseline_s: tuple[float, ...]
    measured_s: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Fastest baseline over fastest measurement (> 1: the measurement is slower)."""
        return min(self.baseline_s) / min(self.measured_s)

    @property
    def spread(self) -> float:
        """The baseline's slowest over its fastest (1.0: steady)."""
        return max(self.baseline_s) / min(self.baseline_s)


def paired(baseline: Callable[[], object], fn: Callable[[], object], repeats: int) -> Paired:
    """Each repeat times the baseline, then `fn` (one untimed warm-up of each first)."""
    baseline(), fn()
    base, measured = [], []
    for _ in range(repeats):
        for fun, out in ((baseline, base), (fn, measured)):
            start = time.perf_counter()
            fun()
            out.append(time.perf_counter() - start)
    return Paired(tuple(base), tuple(measured))


def plain_copy_gbps(num_bytes: int = 64 * 2**20, repeats: int = 7) -> float:
    """The machine's plain memory copy, GB/s: one large tensor copied, the fastest of
    `repeats` (the reference a disturbed baseline is judged against)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return num_bytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def is_disturbed(baseline_gbps: float, reference_gbps: float) -> bool:
    """Whether a baseline copy ran more than `DISTURBED_FACTOR` slower than the machine's."""
    return baseline_gbps * DISTURBED_FACTOR < reference_gbps


def machine() -> dict[str, object]:
    """The CPU a bench ran on, the cores it may use and torch's threads: every bench's
    `ran_on` starts with these, so figures from different machines are never confused."""
    return {
        "cpu": cpu_name(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
    }
