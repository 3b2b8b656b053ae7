"""`kvabi bench disagg`, load part: TTFT and inter-token latency, colocated vs disaggregated,
under a mixed load where long prompts arrive while short requests decode (`mixed_load.py`).

The same seeded requests go, open loop (`serve_load.run_load`), to one colocated `kvabi serve`
and to `kvabi disagg` (router + prefill + decode), both started here as real processes on the
same cores (`serving_setup.py` says how they are pinned). Colocated, a long prompt's prefill
chunks share engine steps with the short requests' decodes, so their inter-token gaps stretch;
disaggregated, the prefill runs on the other instance and only its KV reaches the decoder.
Figures per setup and per kind of request (short, long): TTFT, ITL and end-to-end p50/p99;
`*_ratio` = colocated / disaggregated (above 1: disaggregation is faster). A PNG shows the short
requests' inter-token gaps over time in each setup, their CDF, and the TTFT percentiles.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvabi.abi.table import print_table
from kvabi.bench import serve_load
from kvabi.bench.disagg_load_plot import plot
from kvabi.bench.mixed_load import KINDS, MixedLoad, MixedRequest, make_mixed, of_kind
from kvabi.bench.serve_bench import served_model, summarize
from kvabi.bench.serve_load import Endpoint, RequestResult, WorkloadConfig, make_requests
from kvabi.bench.serving_setup import CoreSplit, colocated, disaggregated, model_args

QUICK = MixedLoad(
    num_short=10,
    short_input_len=32,
    short_output_len=40,
    short_rate=1.0,
    num_long=2,
    long_input_len=1024,
    long_output_len=8,
    long_start_s=2.0,
    long_gap_s=5.0,
)
FULL = MixedLoad(
    num_short=40,
    short_input_len=48,
    short_output_len=96,
    short_rate=1.0,
    num_long=5,
    long_input_len=1536,
    long_output_len=16,
    long_start_s=3.0,
    long_gap_s=8.0,
)
# a long prompt takes ~3.5 s (quick) / ~5 s (full) to prefill on one core here: arriving every
# 5 / 8 s keeps a one-core prefill instance below saturation, so TTFT measures interference,
# not an ever-growing queue
DEFAULT_PLOT = "out/bench/disagg_load.png"
SETUPS = {"colocated": colocated, "disaggregated": disaggregated}
RATIOS = [(kind, name, p) for kind in KINDS for name in ("ttft", "itl") for p in ("p50", "p99")]


@dataclass
class SetupRun:
    """One setup's outcome: a result per request of the load, in the load's order."""

    name: str
    results: list[RequestResult]
    duration_s: float
    host_load_1m: float  # the machine's 1-minute load average as the run ended (noise check)


def run_load(
    quick: bool,
    model: str | None = None,
    dtype: str = "bf16",
    load: MixedLoad | None = None,
    plot_path: str | None = DEFAULT_PLOT,
) -> dict:
    """Run the mixed load against both setups; returns the figures (`*_ratio` at the top)."""
    load = load or (QUICK if quick else FULL)
    split = CoreSplit.of(os.sched_getaffinity(0))
    print(f"\nmixed load, colocated vs disaggregated: {split.describe()}", flush=True)
    requests = make_mixed(load)
    runs = [_measure(name, model_args(model, dtype), split, requests) for name in SETUPS]
    figures = _figures(runs, requests, load, split)
    _print(figures)
    if plot_path:
        plot({run.name: run.results for run in runs}, requests, Path(plot_path))
    return figures


def _measure(
    name: str, model: list[str], split: CoreSplit, requests: list[MixedRequest]
) -> SetupRun:
    print(f"starting {name} (the model loads first) ...", flush=True)
    with SETUPS[name](model, split) as base_url:
        endpoint = Endpoint(base_url, served_model(base_url, None))
        warmup = make_requests(WorkloadConfig(2, 64, 4, seed=7), float("inf"))
        asyncio.run(serve_load.run_load(endpoint, warmup))
        results, duration_s = asyncio.run(serve_load.run_load(endpoint, [r.spec for r in requests]))
    for error in sorted({r.error for r in results if r.error})[:3]:
        print(f"{name}: a request failed: {error}")
    return SetupRun(name, results, duration_s, os.getloadavg()[0])


def _figures(
    runs: list[SetupRun], requests: list[MixedRequest], load: MixedLoad, split: CoreSplit
) -> dict:
    setups = {run.name: _setup_figures(run, requests) for run in runs}
    ratios = {
        f"{kind}_{name}_{p}_ratio": _ratio(
            setups["colocated"][kind]["latency_ms"][name][p],
            setups["disaggregated"][kind]["latency_ms"][name][p],
        )
        for kind, name, p in RATIOS
    }
    details = {"workload": asdict(load), "fairness": split.describe(), "setups": setups}
    return {**ratios, "mixed_load": {**details, "cores_split": split.is_split}}


def _setup_figures(run: SetupRun, requests: list[MixedRequest]) -> dict:
    out: dict = {"duration_s": run.duration_s, "host_load_1m": run.host_load_1m}
    for kind in KINDS:
        results = of_kind(requests, run.results, kind)
        summary = summarize(0.0, results, run.duration_s, None)
        out[kind] = {
            "num_requests": len(results),
            "num_completed": summary.num_completed,
            "num_failed": summary.num_failed,
            "mean_prompt_tokens": summary.mean_prompt_tokens,
            "mean_output_tokens": summary.mean_output_tokens,
            "latency_ms": summary.latency_ms,
        }
    return out


def _ratio(colocated_ms: float, disaggregated_ms: float) -> float:
    if not disaggregated_ms or math.isnan(disaggregated_ms):
        return float("nan")
    return colocated_ms / disaggregated_ms


def _print(figures: dict) -> None:
    details = figures["mixed_load"]
    header = ["setup", "requests", "done", "fail", "prompt tok", "out tok"]
    header += [f"{n} {p}" for n in ("ttft", "itl", "e2e") for p in ("p50", "p99")]
    rows = [
        [name, kind, f[kind]["num_completed"], f[kind]["num_failed"]]
        + [f[kind]["mean_prompt_tokens"], f[kind]["mean_output_tokens"]]
        + [f[kind]["latency_ms"][n][p] for n in ("ttft", "itl", "e2e") for p in ("p50", "p99")]
        for name, f in details["setups"].items()
        for kind in KINDS
    ]
    print_table("mixed load (latencies in ms)", header, rows)
    loads = ", ".join(f"{name} {f['host_load_1m']:.1f}" for name, f in details["setups"].items())
    print(f"host load average (1 min) as each run ended: {loads}; {os.cpu_count()} CPUs")
    print_table(
        "colocated / disaggregated (above 1: disaggregation is faster)",
        ["requests", "ttft p50", "ttft p99", "itl p50", "itl p99"],
        [
            [kind]
            + [figures[f"{kind}_{n}_{p}_ratio"] for n in ("ttft", "itl") for p in ("p50", "p99")]
            for kind in KINDS
        ],
    )
