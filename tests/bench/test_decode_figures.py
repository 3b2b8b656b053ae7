"""`kvabi bench decode`'s figures from step times: fastest early and late, the first step out."""

from __future__ import annotations

import pytest

from kvabi.bench.decode_bench import _figures


def test_fastest_steps_of_the_first_and_last_windows_and_their_ratios():
    late = [(0.021, 0.017), (0.020, 0.017), (0.9, 0.1), (0.023, 0.019)]
    steps = [(0.005, 0.001), (0.012, 0.008), (0.010, 0.008), (0.5, 0.1), (0.011, 0.008), *late]
    figures = _figures(steps, window=4)  # early: steps 1-4 (not the faster first), one slowed
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
