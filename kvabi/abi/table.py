"""Plain-text tables: what the `kvabi` command and the benches print."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print `title`, then the rows under `header`, columns aligned (text left, rest right)."""
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


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
