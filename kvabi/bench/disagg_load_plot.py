"""The PNG of `kvabi bench disagg`'s load part: short requests' inter-token gaps over time per
setup (long prompts' arrival-to-first-token spans shaded), their CDF, and TTFT percentiles."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvabi.bench.mixed_load import KINDS, MixedRequest, of_kind
from kvabi.bench.serve_load import RequestResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {"colocated": "tab:red", "disaggregated": "tab:blue"}


def token_gaps(request: MixedRequest, result: RequestResult) -> tuple[np.ndarray, np.ndarray]:
    """(times since the run's start at which each gap ended, the gaps), in seconds."""
    if result.ttft_s is None:
        return np.zeros(0), np.zeros(0)
    gaps = np.array(result.itl_s)
    return request.spec.arrival_s + result.ttft_s + np.cumsum(gaps), gaps


def plot(runs: dict[str, list[RequestResult]], requests: list[MixedRequest], path: Path) -> None:
    """Write the 2x2 figure to `path` (skipped, with a line saying so, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (the dev extra has it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    for ax, (name, results) in zip(axes[0], runs.items(), strict=True):
        _timeline(ax, name, results, requests)
    axes[0][1].sharey(axes[0][0])
    _cdf(axes[1][0], runs, requests)
    _ttft_bars(axes[1][1], runs, requests)
    fig.suptitle("kvabi bench disagg: mixed load, colocated vs disaggregated")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def _timeline(
    ax: Axes, name: str, results: list[RequestResult], requests: list[MixedRequest]
) -> None:
    for request, result in zip(requests, results, strict=True):
        if request.kind == "long":
            end = request.spec.arrival_s + (result.ttft_s or 0.0)
            ax.axvspan(request.spec.arrival_s, end, color="0.85", zorder=0)
        else:
            times, gaps = token_gaps(request, result)
            ax.plot(times, gaps * 1000, ".", ms=3, color=COLORS.get(name, "k"))
    ax.set(title=f"{name}: short requests' inter-token gaps", xlabel="s since start", ylabel="ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def _cdf(ax: Axes, runs: dict[str, list[RequestResult]], requests: list[MixedRequest]) -> None:
    for name, results in runs.items():
        gaps = np.sort([g for r in of_kind(requests, results, "short") for g in r.itl_s])
        if len(gaps):
            ax.plot(
                gaps * 1000,
                np.arange(1, len(gaps) + 1) / len(gaps),
                label=name,
                color=COLORS.get(name, "k"),
            )
    ax.set(title="short requests: ITL CDF", xlabel="inter-token gap (ms)", ylabel="fraction")
    ax.set_xscale("log")
    ax.set_xlim(left=1.0)  # gaps under 1 ms: two tokens read together off the socket
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _ttft_bars(
    ax: Axes, runs: dict[str, list[RequestResult]], requests: list[MixedRequest]
) -> None:
    labels = [f"{kind} {p}" for kind in KINDS for p in ("p50", "p99")]
    x, width = np.arange(len(labels)), 0.8 / max(len(runs), 1)
    for i, (name, results) in enumerate(runs.items()):
        values = []
        for kind in KINDS:
            ttft = [r.ttft_s for r in of_kind(requests, results, kind) if r.ttft_s is not None]
            values += list(np.percentile(ttft, [50, 99]) * 1000) if ttft else [0.0, 0.0]
        ax.bar(x + i * width, values, width, label=name, color=COLORS.get(name, "k"))
    ax.set_xticks(x + width * (len(runs) - 1) / 2, labels)
    ax.set(title="TTFT", ylabel="ms", yscale="log")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
