"""`kvabi bench throughput`'s figures from the workers' results (no engines run here)."""

from kvabi.bench.throughput import _agreeing, _figures


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
        "kvabi-bf16": _result(0.1, 40.0, 150.0, [7, 8, 5, 10]),
    }
    figures = _figures(results, work, ["bf16"])
    assert figures["bf16_ttft_ratio"] == 2.0 and figures["bf16_decode_ratio"] == 4.0
    assert figures["bf16_concurrent_ratio"] == 3.0
    assert figures["bf16_greedy_tokens_match_hf"] is False
    assert figures["bf16_greedy_tokens_agree_with_hf"] == "2/4"


def test_agreeing_counts_the_shared_leading_tokens():
    assert _agreeing([1, 2, 3], [1, 2, 3]) == "3/3"
    assert _agreeing([1, 2, 3], [4, 2, 3]) == "0/3"
    assert _agreeing([1, 2], [1, 2, 3]) == "2/3"
