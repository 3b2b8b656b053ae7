"""`kvabi bench serve`: the seeded open-loop workload, the figures, and a run against the server."""

from __future__ import annotations

import json
import statistics

import pytest

from kvabi.bench.serve_bench import summarize
from kvabi.bench.serve_load import WORDS, RequestResult, WorkloadConfig, make_requests
from kvabi.cli.main import main
from tests.server.tiny_server import tiny_folder

CONFIG = WorkloadConfig(num_requests=50, input_len=20, output_len=10, seed=4)


def test_every_rate_sends_the_same_seeded_requests_at_its_own_times():
    slow, fast = make_requests(CONFIG, 1.0), make_requests(CONFIG, 10.0)
    assert [(s.prompt, s.max_tokens) for s in slow] == [(s.prompt, s.max_tokens) for s in fast]
    assert slow == make_requests(CONFIG, 1.0)  # seeded
    assert make_requests(WorkloadConfig(50, 20, 10, seed=5), 1.0) != slow
    assert [s.arrival_s for s in slow] == pytest.approx([10 * s.arrival_s for s in fast])
    assert all(5 <= s.max_tokens <= 15 for s in slow)  # 10 * [0.5, 1.5]
    assert all(
        10 <= len(s.prompt.split()) <= 30 and set(s.prompt.split()) <= set(WORDS) for s in slow
    )


def test_arrivals_are_a_poisson_process_of_the_rate():
    specs = make_requests(WorkloadConfig(4000, 4, 4), rate=8.0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(specs, specs[1:], strict=False)]
    assert specs[0].arrival_s == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.08)  # exponential: sd = mean
    assert {s.arrival_s for s in make_requests(CONFIG, float("inf"))} == {0.0}


def test_shared_prefixes_open_every_prompt():
    specs = make_requests(WorkloadConfig(40, 30, 4, prefix_len=12, num_prefixes=3), 1.0)
    prefixes = {" ".join(s.prompt.split()[:12]) for s in specs}
    assert len(prefixes) == 3


def test_summary_percentiles_and_the_ratio_to_the_lowest_rate():
    results = [RequestResult(True, 0.1 * i, [0.01, 0.03], 1.0 + i, 7, 3) for i in range(1, 11)] + [
        RequestResult(error="HTTP 503")
    ]
    figures = summarize(rate=4.0, results=results, duration_s=5.0, base_e2e_p50_ms=1300.0)
    assert (figures.num_completed, figures.num_failed) == (10, 1)
    assert figures.request_throughput == 2.0 and figures.e2e_p50_ratio == pytest.approx(5.0)
    assert figures.output_throughput == 6.0 and figures.mean_prompt_tokens == 7.0
    assert figures.latency_ms["ttft"]["p50"] == pytest.approx(550.0)
    assert figures.latency_ms["e2e"]["p90"] == pytest.approx(10_100.0)
    assert figures.latency_ms["itl"]["p99"] == pytest.approx(30.0)


def test_bench_serve_starts_a_server_loads_it_and_reports(tmp_path, capsys):
    folder = tiny_folder(tmp_path / "tiny-chat")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    args = ["bench", "serve", "--model", str(folder), "--dtype", "fp32", "--rate", "10"]
    args += ["--rate", "50", "--num-prompts", "6", "--input-len", "6", "--output-len", "5"]
    assert main([*args, "--json", str(out), "--plot", str(png)]) == 0
    figures = json.loads(out.read_text())
    workload = WorkloadConfig(6, 6, 5)
    expected_tokens = statistics.mean(s.max_tokens for s in make_requests(workload, 1.0))
    assert figures["model"] == "tiny-chat" and [r["rate"] for r in figures["rates"]] == [10, 50]
    assert figures["rates"][0]["e2e_p50_ratio"] == 1.0
    for rate in figures["rates"]:
        assert (rate["num_completed"], rate["num_failed"]) == (6, 0)
        assert rate["mean_output_tokens"] == pytest.approx(expected_tokens)  # ignore_eos: exact
        for name in ("ttft", "itl", "e2e"):
            p = rate["latency_ms"][name]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ttft p99" in capsys.readouterr().out
