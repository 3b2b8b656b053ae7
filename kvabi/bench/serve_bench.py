"""`kvabi bench serve`: latency and throughput of an OpenAI endpoint under Poisson load.

Each rate sends the same seeded requests (open loop, `serve_load.py`) and reports throughput and
TTFT / inter-token latency / end-to-end p50, p90, p99. `e2e_p50_ratio` is the median end-to-end
latency over that of the lowest rate in the same run: 1.0 while the server keeps up, rising once
it saturates. Against `--base-url` (any OpenAI endpoint) or, without it, a `kvabi serve` this
command starts on a free local port and stops at the end. A PNG plots latency against rate.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from kvabi.abi.table import print_table
from kvabi.bench.report import write_json
from kvabi.bench.serve_load import Endpoint, RequestResult, WorkloadConfig, make_requests, run_load

QUICK = {"rates": [1.0, 4.0], "num_requests": 12, "input_len": 64, "output_len": 32}
FULL = {"rates": [0.5, 1.0, 2.0, 4.0, 8.0], "num_requests": 48, "input_len": 256, "output_len": 96}
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "e2e")


@dataclass(frozen=True)
class RateFigures:
    rate: float
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # generated tokens per second
    e2e_p50_ratio: float  # median e2e latency / that of the lowest rate (set by bench_rates)
    mean_prompt_tokens: float
    mean_output_tokens: float
    latency_ms: dict[str, dict[str, float]]  # ttft/itl/e2e -> p50/p90/p99


def summarize(
    rate: float, results: list[RequestResult], duration_s: float, base_e2e_p50_ms: float | None
) -> RateFigures:
    """One rate's figures; `base_e2e_p50_ms`: the lowest rate's median (None: this is it)."""
    done = [r for r in results if r.ok]
    samples = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    latency = {name: _percentiles_ms(values) for name, values in samples.items()}
    base = latency["e2e"]["p50"] if base_e2e_p50_ms is None else base_e2e_p50_ms
    return RateFigures(
        rate=rate,
        num_completed=len(done),
        num_failed=len(results) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=sum(r.output_tokens for r in done) / duration_s,
        e2e_p50_ratio=latency["e2e"]["p50"] / base,
        mean_prompt_tokens=float(np.mean([r.prompt_tokens for r in done])) if done else 0.0,
        mean_output_tokens=float(np.mean([r.output_tokens for r in done])) if done else 0.0,
        latency_ms=latency,
    )


def _percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    found = np.percentile(np.array(values) * 1000.0, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, found, strict=True)}


def bench_rates(
    endpoint: Endpoint, workload: WorkloadConfig, rates: list[float]
) -> list[RateFigures]:
    """Warm the endpoint with one request, then run each rate, lowest first."""
    warmup = make_requests(WorkloadConfig(1, 8, 4, seed=workload.seed + 7), float("inf"))
    asyncio.run(run_load(endpoint, warmup))
    figures: list[RateFigures] = []
    for rate in sorted(set(rates)):
        results, duration = asyncio.run(run_load(endpoint, make_requests(workload, rate)))
        base = figures[0].latency_ms["e2e"]["p50"] if figures else None
        figures.append(summarize(rate, results, duration, base))
        errors = sorted({r.error for r in results if r.error})
        if errors:
            print(f"rate {rate}: {figures[-1].num_failed} failed, e.g. {errors[:3]}")
    return figures


def print_figures(figures: list[RateFigures], title: str) -> None:
    header = ["rate/s", "done", "fail", "req/s", "tok/s", "e2e_p50_ratio"]
    header += [f"{n} p{p}" for n in LATENCIES for p in PERCENTILES]
    rows = [
        [f.rate, f.num_completed, f.num_failed, f.request_throughput, f.output_throughput]
        + [f.e2e_p50_ratio]
        + [f.latency_ms[n][f"p{p}"] for n in LATENCIES for p in PERCENTILES]
        for f in figures
    ]
    print_table(f"{title} (latencies in ms)", header, rows)


def plot(figures: list[RateFigures], path: Path, title: str) -> None:
    """Latency (p50 and p99, log scale) of TTFT, ITL and end-to-end against the offered rate."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (the dev extra has it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [f.rate for f in figures]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, name in zip(axes, LATENCIES, strict=True):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [f.latency_ms[name][p] for f in figures], style, label=p)
        ax.set(title=name, xlabel="offered rate (requests/s)", ylabel="ms", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model an endpoint lists under /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> list[RateFigures]:
    """`kvabi bench serve`: against --base-url, or a `kvabi serve` started (and stopped) here."""
    size = QUICK if args.quick else FULL
    workload = WorkloadConfig(
        num_requests=args.num_prompts or size["num_requests"],
        input_len=args.input_len or size["input_len"],
        output_len=args.output_len or size["output_len"],
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.seed,
    )
    rates = args.rate or size["rates"]
    if args.base_url:
        return _report(args, args.base_url.rstrip("/"), workload, rates)
    from kvabi.server.launch import ServerProcess

    serve_args = ["--log-level", "warning", "--dtype", (args.dtype or ["bf16"])[0]]
    serve_args += ["--model", args.model] if args.model else []
    print("starting kvabi serve (the model loads first) ...", flush=True)
    with ServerProcess(serve_args, env={"KVABI_API_KEY": ""}) as server:
        return _report(args, server.base_url, workload, rates)


def _report(
    args: argparse.Namespace, base_url: str, workload: WorkloadConfig, rates: list[float]
) -> list[RateFigures]:
    api_key = args.api_key or None
    model = args.model if args.base_url and args.model else served_model(base_url, api_key)
    endpoint = Endpoint(base_url, model, api_key, ignore_eos=not args.no_ignore_eos)
    figures = bench_rates(endpoint, workload, rates)
    title = f"kvabi bench serve: {model} at {base_url}"
    print_figures(figures, title)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(
        args.json,
        {
            "endpoint": base_url,
            "model": model,
            "workload": asdict(workload),
            "rates": [asdict(f) for f in figures],
        },
    )
    plot(figures, Path(args.plot), title)
    return figures
