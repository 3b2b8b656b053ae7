"""ModelConfig / RopeScaling validation: every bad value is a ValueError naming its field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvabi.models import ModelConfig, RopeScaling

GOOD: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
}


def test_a_good_config_builds() -> None:
    config = ModelConfig(**GOOD, eos_token_ids=[2, 3])  # type: ignore[arg-type]
    assert config.eos_token_ids == (2, 3)  # normalised to a tuple
    assert config.num_queries_per_kv == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("hidden_size", -1),
        ("intermediate_size", 0),
        ("num_layers", 0),
        ("num_heads", 0),
        ("num_kv_heads", 3),  # does not divide num_heads
        ("head_dim", 15),  # odd: RoPE rotates pairs
        ("rope_theta", 0.0),
        ("rms_norm_eps", 0.0),
        ("max_position_embeddings", 0),
        ("sliding_window", 0),
        ("bos_token_id", 96),
        ("eos_token_ids", (2, 500)),
        ("architecture", "gpt2"),
    ],
)
def test_bad_values_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        ModelConfig(**{**GOOD, field: value})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_type": "yarn"}, "rope_type"),
        ({"factor": 0.0}, "factor"),
        ({"low_freq_factor": 0.0}, "low_freq_factor"),
        ({"high_freq_factor": 1.0}, "high_freq_factor"),  # must exceed low_freq_factor
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ],
)
def test_bad_rope_scaling_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        RopeScaling(**{"rope_type": "llama3", "factor": 8.0, **changes})


def test_linear_scaling_ignores_llama3_fields() -> None:
    assert RopeScaling("linear", 2.0, low_freq_factor=0.0).factor == 2.0
