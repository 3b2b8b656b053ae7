"""`kvabi bench throughput`'s figures from the workers' results (no engines run here)."""

import sys
from pathlib import Path

from kvabi.bench.throughput import (
    _agreeing,
    _engines,
    _figures,
    _paired_figures,
    _run_worker,
    dtype_names,
    gguf_quant,
    paired_batch1,
)
from kvabi.native.cpu_kernels import has_native_bf16


def _result(ttft, decode, concurrent, tokens):
    return {
        "batch1_ttft_s": ttft,
        "batch1_decode_tok_s": decode,
        "concurrent_tok_s": concurrent,
        "batch1_tokens": tokens,
    }


def test_ratios_and_token_agreement_against_hf():
    work = {"batch1": {"prompt_ids": [1] * 5, "max_tokens": 4}, "concurrent": [{}] * 16}
    results = {
        "hf-bf16": _result(0.2, 10.0, 50.0, [7, 8, 9, 10]),
        "kvabi-bf16": _result(0.1, 40.0, 150.0, [7, 8, 5, 10]) | {"ran_on": {"cpu": "X"}},
        "llamacpp-q4_1": _result(0.1, 40.0, 150.0, [7]) | {"cpu_path": "AVX2 = 1"},
        "vllm-bf16": "skipped: vLLM not installed",
    }
    figures = _figures(results, work, ["bf16"])
    assert figures["bf16_ttft_ratio"] == 2.0 and figures["bf16_decode_ratio"] == 4.0
    assert figures["bf16_concurrent_ratio"] == 3.0
    assert figures["bf16_greedy_tokens_match_hf"] is False
    assert figures["bf16_greedy_tokens_agree_with_hf"] == "2/4"
    assert figures["ran_on"] == {"cpu": "X", "llamacpp_cpu_path": "AVX2 = 1"}
    assert figures["engines"]["vllm-bf16"] == "skipped: vLLM not installed"


def test_ratios_against_vllm_and_llamacpp_at_both_precisions():
    work = {"batch1": {"prompt_ids": [1] * 5, "max_tokens": 4}, "concurrent": [{}] * 16}
    results = {
        "hf-bf16": _result(0.2, 10.0, 50.0, [7]),
        "kvabi-bf16": _result(0.1, 60.0, 200.0, [7]),
        "llamacpp-bf16": _result(0.1, 40.0, 50.0, [7]),
        "llamacpp-q4_1": _result(0.1, 80.0, 100.0, [7]),
        "vllm-bf16": _result(0.1, 30.0, 160.0, [7]),
    }
    figures = _figures(results, work, ["bf16"], "q4_1")
    assert figures["bf16_decode_vs_llamacpp_ratio"] == 1.5
    assert figures["bf16_concurrent_vs_llamacpp_ratio"] == 4.0
    assert figures["bf16_decode_vs_llamacpp_q4_1_ratio"] == 0.75
    assert figures["bf16_decode_vs_vllm_ratio"] == 2.0
    assert figures["bf16_concurrent_vs_vllm_ratio"] == 1.25
    # a peer that did not run gives no ratio (rather than a made-up one)
    results["vllm-bf16"] = "skipped: vLLM not installed"
    assert "bf16_decode_vs_vllm_ratio" not in _figures(results, work, ["bf16"], "q4_1")


def test_llamacpp_runs_on_the_shipped_gguf_and_on_it_in_each_dtype():
    assert _engines(["bf16"], "smollm2-135m-instruct") == [
        ("hf", "bf16"), ("kvabi", "bf16"), ("llamacpp", "bf16"), ("llamacpp", "q4_1"),
        ("vllm", "bf16"),
    ]  # fmt: skip


def test_auto_is_the_dtype_this_cpu_computes_natively():
    native = "bf16" if has_native_bf16() else "fp32"
    assert dtype_names(None) == dtype_names(["auto"]) == [native]
    assert dtype_names(["fp32", "auto", "bf16"]) == list(dict.fromkeys(["fp32", native, "bf16"]))


def test_the_llamacpp_label_is_the_ggufs_quantisation():
    assert gguf_quant("smollm2-135m-instruct") == "q4_1"


def test_a_worker_that_skips_says_why_and_one_that_fails_says_failed(tmp_path: Path):
    def worker(code: str) -> dict | str:
        return _run_worker([sys.executable, "-c", code], tmp_path / "out.json")

    assert worker("raise SystemExit('skipped: no vLLM here')") == "skipped: no vLLM here"
    assert worker("raise RuntimeError('boom')") == "failed: RuntimeError: boom"


def test_agreeing_counts_the_shared_leading_tokens():
    assert _agreeing([1, 2, 3], [1, 2, 3]) == "3/3"
    assert _agreeing([1, 2, 3], [4, 2, 3]) == "0/3"
    assert _agreeing([1, 2], [1, 2, 3]) == "2/3"


def _serving(name: str, log: Path, rate: float) -> list[str]:
    """A stand-in `--serve-batch1` worker: noise, "ready", then one JSON line per "batch1" line,
    each answer logged (its name) to `log` so the order of turns shows."""
    code = (
        "import json, sys\n"
        "print('loading...'); print('ready', flush=True)\n"
        "for line in sys.stdin:\n"
        f"    open({str(log)!r}, 'a').write({name!r} + ' ')\n"
        f"    print(json.dumps({{'batch1_decode_tok_s': {rate}}}), flush=True)\n"
    )
    return [sys.executable, "-c", code]


def test_paired_batch1_takes_turns_in_alternating_order_and_gives_each_rounds_ratio(tmp_path):
    log = tmp_path / "turns"
    rounds = paired_batch1([_serving("k", log, 90.0), _serving("l", log, 100.0)], 4)
    assert log.read_text().split() == ["k", "l", "l", "k", "k", "l", "l", "k"]
    assert [r["kvabi"]["batch1_decode_tok_s"] for r in rounds] == [90.0] * 4
    figures = _paired_figures(rounds, "bf16")
    assert figures["bf16_decode_vs_llamacpp_paired_ratio"] == 0.9


def test_paired_ratio_is_the_median_round_with_its_spread():
    rounds = [
        {"kvabi": {"batch1_decode_tok_s": k}, "llamacpp": {"batch1_decode_tok_s": 100.0}}
        for k in (80.0, 120.0, 100.0, 104.0, 96.0)
    ]
    figures = _paired_figures(rounds, "bf16")
    assert figures["bf16_decode_vs_llamacpp_paired_ratio"] == 1.0
    assert figures["bf16_decode_vs_llamacpp_paired_min_ratio"] == 0.8
    assert figures["bf16_decode_vs_llamacpp_paired_max_ratio"] == 1.2


def test_a_paired_worker_that_dies_gives_its_reason_and_no_ratio(tmp_path):
    dead = [sys.executable, "-c", "raise SystemExit('no llama_cpp here')"]
    got = paired_batch1([_serving("k", tmp_path / "turns", 90.0), dead], 2)
    assert got == "failed: no llama_cpp here"
    figures = _paired_figures(got, "bf16")
    assert not any(k.endswith("_ratio") for k in figures)
