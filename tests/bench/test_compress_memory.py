"""`kvabi bench compress`'s memory figures (from the descriptors) against hand arithmetic of
DeepSeek-V4-Flash's cache: 43 layers, K=V rows of 512 in windows of 128 (stored as K and V),
20 CSA layers (m = 4, index 128, a float32 state record of 4 x 2 x (512 + 128) values per
block of 128) and 23 HCA layers (m' = 128), bf16; 1M = 2^20 tokens."""

from __future__ import annotations

from kvabi.bench.compress_bench import MILLION, memory


def test_memory_figures_are_the_arithmetic() -> None:
    f = memory()
    window = 128 * 2 * 512 * 2  # a window's K and V, bf16: per layer, whatever the context
    hca = MILLION // 128 * 512 * 2
    csa = MILLION // 4 * (512 + 128) * 2 + MILLION // 128 * 4 * 2 * (512 + 128) * 4
    assert (f["v4_window_layers"], f["v4_entries_1_4_layers"], f["v4_entries_1_128_layers"]) == (
        43, 20, 23,
    )  # fmt: skip
    assert f["v4_window_bytes_per_layer_1m"] == window
    assert f["v4_entries_1_128_bytes_per_layer_1m"] == hca
    assert f["v4_entries_1_4_bytes_per_layer_1m"] == csa
    total = 43 * window + 23 * hca + 20 * csa
    assert f["v4_bytes_1m"] == total
    assert f["v4_uncompressed_bytes_1m"] == 43 * MILLION * 512 * 2  # a K=V row a token a layer
    assert f["v3_mla_bytes_1m"] == 61 * MILLION * 576 * 2
    assert f["v4_vs_uncompressed_ratio"] == total / (43 * MILLION * 512 * 2)
    assert f["press_snapkv_8x_kept_ratio"] == 512 / 4096
