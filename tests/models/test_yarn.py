"""YaRN tables equal transformers' `_compute_yarn_parameters` to the bit, and DeepSeek's softmax
mscale equals its `yarn_apply_mscale`, over the parameter combinations HF treats differently."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvabi.models.deepseek_v3_config import read_deepseek_v3_config
from kvabi.models.errors import CheckpointError
from kvabi.models.yarn import YarnScaling

transformers = pytest.importorskip("transformers")
BASE = {"rope_type": "yarn", "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}
CASES: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (max_position_embeddings, params)
    # DeepSeek-V3's own: both mscales 1, so cos/sin stay unscaled and the softmax scale moves
    "deepseek-v3": (163840, {**BASE, "factor": 40.0, "original_max_position_embeddings": 4096,
                             "mscale": 1.0, "mscale_all_dim": 1.0}),
    # mscale without mscale_all_dim: HF's cos/sin factor is mscale(factor), mscale ignored
    "mscale-only": (2048, {**BASE, "factor": 8.0, "original_max_position_embeddings": 256,
                           "mscale": 0.707}),
    # an explicit attention_factor, and the blend range left unrounded
    "explicit-untruncated": (1024, {**BASE, "rope_theta": 500.0, "factor": 4.0,
                                    "original_max_position_embeddings": 256,
                                    "attention_factor": 1.25, "truncate": False,
                                    "beta_fast": 16, "beta_slow": 2}),
}  # fmt: skip


def hf_config(max_positions: int, params: dict[str, Any]) -> Any:
    return transformers.DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=max_positions, rope_parameters=dict(params)
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_equal_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = hf_config(*CASES[case])
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = read_deepseek_v3_config(config.to_dict())
    yarn = ours.rope_scaling
    assert yarn is not None
    assert torch.equal(yarn.inv_freq(64, ours.rope_theta), want_inv_freq)
    assert yarn.cos_sin_factor == want_factor
    assert ours.softmax_scale == yarn_apply_mscale(config.rope_parameters, config.qk_head_dim**-0.5)


def test_the_cases_differ() -> None:
    """Each case's table differs from plain RoPE's at its theta, in the blended band too."""
    for max_positions, params in CASES.values():
        theta = params["rope_theta"]
        plain = 1.0 / (theta ** (torch.arange(0, 64, 2).float() / 64))
        yarn = read_deepseek_v3_config(hf_config(max_positions, params).to_dict()).rope_scaling
        assert yarn is not None
        ratio = plain / yarn.inv_freq(64, theta)  # 1 kept, factor divided, between: blended
        is_blended = (ratio > 1 + 1e-4) & (ratio < params["factor"] * (1 - 1e-4))
        assert ratio[0] == 1 and bool(is_blended.any())


@pytest.mark.parametrize(
    ("change", "field"),
    [({"factor": 0.0}, "factor"), ({"beta_fast": 1.0}, "beta_fast")],
)
def test_bad_values_name_the_field(change: dict[str, float], field: str) -> None:
    with pytest.raises(CheckpointError, match=f"rope_parameters.{field}"):
        YarnScaling(**{"factor": 4.0, "original_max_position_embeddings": 64, **change})
