"""`kvabi bench disagg`, load part: the mixed workload, the core split, and a run of both
setups (colocated `kvabi serve`, `kvabi disagg`) as real processes on the tiny model."""

from __future__ import annotations

import math

import pytest

from kvabi.bench.disagg_load import RATIOS, run_load
from kvabi.bench.mixed_load import MixedLoad, make_mixed
from kvabi.bench.serving_setup import CoreSplit
from tests.server.tiny_server import tiny_folder

LOAD = MixedLoad(
    num_short=5,
    short_input_len=4,
    short_output_len=6,
    short_rate=20.0,
    num_long=2,
    long_input_len=40,  # words; about 200 tokens with the tiny byte-level tokenizer
    # Long enough that each long request streams several text chunks: the tiny model's
    # byte-level tokens often complete no character, and a request whose text arrives in one
    # chunk has no inter-token gap (CI once saw none over two 3-4 token requests: ITL nan).
    long_output_len=12,
    long_start_s=0.05,
    long_gap_s=0.1,
)


def test_mixed_load_is_seeded_ordered_and_puts_long_prompts_at_fixed_times():
    requests = make_mixed(LOAD)
    assert make_mixed(LOAD) == requests
    arrivals = [r.spec.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    long = [r for r in requests if r.kind == "long"]
    assert [r.spec.arrival_s for r in long] == pytest.approx([0.05, 0.15])
    assert [r.kind for r in requests].count("short") == 5
    assert all(len(r.spec.prompt.split()) >= 30 for r in long)  # 40 * [0.75, 1.25]
    assert all(len(r.spec.prompt.split()) <= 5 for r in requests if r.kind == "short")
    short_prompts = {r.spec.prompt for r in requests if r.kind == "short"}
    assert not short_prompts & {r.spec.prompt for r in long}


def test_core_split_halves_the_cores_and_says_when_it_cannot():
    split = CoreSplit.of({3, 1, 2, 0})
    assert (split.cores, split.prefill, split.decode) == ((0, 1, 2, 3), (0, 1), (2, 3))
    assert split.is_split and split.threads_per_role == 2
    one = CoreSplit.of({5})
    assert (one.prefill, one.decode, one.is_split) == ((5,), (5,), False)
    assert "ONE core" in one.describe() and "ONE core" not in split.describe()


def test_both_setups_serve_every_request_and_report_the_figures(tmp_path):
    folder = tiny_folder(tmp_path / "tiny")
    png = tmp_path / "load.png"
    figures = run_load(True, model=str(folder), dtype="fp32", load=LOAD, plot_path=str(png))
    assert set(figures) == {f"{k}_{n}_{p}_ratio" for k, n, p in RATIOS} | {"mixed_load"}
    assert all(math.isfinite(figures[f"{k}_{n}_{p}_ratio"]) for k, n, p in RATIOS)
    details = figures["mixed_load"]
    assert details["workload"]["num_short"] == 5 and "colocated: kvabi serve" in details["fairness"]
    expected_tokens = {
        kind: [r.spec.max_tokens for r in make_mixed(LOAD) if r.kind == kind]
        for kind in ("short", "long")
    }
    assert set(details["setups"]) == {"colocated", "disaggregated"}
    for setup in details["setups"].values():
        assert setup["duration_s"] > 0 and setup["host_load_1m"] >= 0
        for kind, tokens in expected_tokens.items():
            f = setup[kind]
            assert (f["num_requests"], f["num_completed"], f["num_failed"]) == (
                len(tokens),
                len(tokens),
                0,
            )
            assert f["mean_output_tokens"] == pytest.approx(sum(tokens) / len(tokens))  # ignore_eos
            for name in ("ttft", "itl", "e2e"):
                assert 0 < f["latency_ms"][name]["p50"] <= f["latency_ms"][name]["p99"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
