"""`kvabi bench mla` at a tiny size: its JSON holds the *_ratio figures, the byte figures are
DeepSeek-V3's exactly (from the descriptors), and fp8_ds_mla's teacher-forced logits stay within
a bound of the bf16 cache's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvabi.bench import mla_bench

pytest.importorskip("transformers")

# Measured at TINY (2 layers, hidden 64, 4 prompts x 8 steps, bf16 logit std 0.98): top-1
# agreement 0.94 (2 flips of 32, at top-2 margins 0.03 and 0.125, under twice that step's
# |dlogit|: near-ties), max |dlogit| 0.22, mean 0.04. fp8 e4m3 rounds each latent to within
# 2^-5 of itself (half its 2^-4 relative step), so logits move by a fraction of their spread:
# the bounds below leave 2x over the measured error. They still fail a cache read back wrong:
# latents dequantised 1.25x too large gave max |dlogit| 1.10 and top-1 0.69; the four 128-value
# tiles in reverse order gave 5.4 and 0.0 (both measured by patching the record decoder).
MAX_DLOGIT_OF_STD = 0.5
MIN_TOP1 = 0.75


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("mla") / "mla.json"
    mla_bench.run(False, str(path), mla_bench.TINY)
    return json.loads(Path(path).read_text())


def test_json_has_every_ratio(figures: dict) -> None:
    ratios = {k for k in figures if k.endswith("_ratio")}
    want = {"expanded_vs_bf16_ratio", "expanded_vs_fp8_ratio", "bf16_vs_fp8_ratio"}
    want |= {"fp8_top1_agreement_ratio"}
    want |= {f"batch{b}_{c}_vs_hf_ratio" for b in (1, 16) for c in ("bf16", "fp8")}
    assert ratios == want
    assert all(figures[k] > 0 for k in ratios)
    assert figures["decode_dtype"] in ("bf16", "fp32") and "cpu" in figures["ran_on"]


def test_bytes_per_token_per_layer_are_deepseek_v3s(figures: dict) -> None:
    assert figures["num_layers"] == 61
    assert figures["bf16_bytes_per_token_layer"] == 576 * 2 == 1152
    assert figures["fp8_bytes_per_token_layer"] == 512 + 4 * 4 + 64 * 2 == 656
    assert figures["expanded_bytes_per_token_layer"] == 128 * (192 + 128) * 2 == 81920
    assert figures["bf16_request_bytes"] == 61 * 1152 * 131072
    assert figures["fp8_request_bytes"] == 61 * 656 * 131072
    assert figures["expanded_vs_bf16_ratio"] == 81920 / 1152
    assert figures["bf16_vs_fp8_ratio"] == 1152 / 656


def test_fp8_logits_within_bound_of_bf16(figures: dict) -> None:
    assert figures["num_prompts"] * figures["num_steps"] == 32
    assert 0 < figures["max_abs_dlogit"] < MAX_DLOGIT_OF_STD * figures["bf16_logit_std"]
    assert figures["fp8_top1_agreement_ratio"] >= MIN_TOP1
