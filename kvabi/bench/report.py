"""Shared bench output: timings and, on request, one JSON object (tables: kvabi/abi/table.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


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
