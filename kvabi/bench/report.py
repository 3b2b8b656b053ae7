"""Shared bench output: a readable table on stdout and, on request, one JSON object."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
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


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in [list(header), *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, figures: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        print(f"\nfigures written to {path}")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
