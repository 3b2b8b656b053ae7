"""`kvabi bench decode`'s figures from step times: medians early and late, the first step out."""

from __future__ import annotations

import pytest

from kvabi.bench.decode_bench import _figures


def test_medians_of_the_first_and_last_windows_and_their_ratios():
    steps = [(1.0, 0.9)] + [(0.010, 0.008)] * 3 + [(0.5, 0.1)] + [(0.020, 0.017)] * 4
    figures = _figures(steps, window=4)  # early: steps 1-4, one of them an outlier
    assert figures == pytest.approx(
        {
            "early_ms": 10.0,
            "late_ms": 20.0,
            "late_vs_early_ratio": 2.0,
            "outside_forward_early_ms": 2.0,
            "outside_forward_late_ms": 3.0,
            "outside_forward_late_vs_early_ratio": 1.5,
        }
    )
