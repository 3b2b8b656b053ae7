"""RoPE: inverse frequencies equal HF's bit for bit; Llama-3 divisors round-trip through the fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvabi.models import RopeScaling
from kvabi.models.rope import (
    RotaryEmbedding,
    apply_rope,
    fit_llama3_scaling,
    llama3_freq_factors,
    scaled_inv_freq,
)
from tests.models.tiny import LLAMA3_ROPE, make_hf

LLAMA31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)  # Llama 3.1/3.2's values


@pytest.mark.parametrize(
    ("rope_parameters", "scaling"),
    [
        (None, None),
        ({"rope_type": "linear", "factor": 2.0}, RopeScaling("linear", 2.0)),
        (LLAMA3_ROPE, RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    ],
)
def test_inv_freq_equals_transformers(
    rope_parameters: dict | None, scaling: RopeScaling | None
) -> None:
    pytest.importorskip("transformers")
    hf = make_hf(
        "llama", **({} if rope_parameters is None else {"rope_parameters": rope_parameters})
    )
    assert torch.equal(scaled_inv_freq(16, 10000.0, scaling), hf.model.rotary_emb.inv_freq)


def test_fit_recovers_llama31_scaling() -> None:
    factors = llama3_freq_factors(128, 500000.0, LLAMA31)
    fitted = fit_llama3_scaling(factors, 128, 500000.0, 8192)
    np.testing.assert_allclose(
        (fitted.factor, fitted.low_freq_factor, fitted.high_freq_factor), (8.0, 1.0, 4.0), rtol=1e-5
    )


def test_fit_rejects_divisors_that_are_not_llama3() -> None:
    factors = llama3_freq_factors(128, 500000.0, LLAMA31)
    factors[-1] = 3.0  # lowest frequency should have been divided by the full factor
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        fit_llama3_scaling(factors, 128, 500000.0, 8192)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        fit_llama3_scaling(np.ones(64), 128, 500000.0, 8192)


def test_rotation_preserves_norms_and_position_zero_is_identity() -> None:
    rope = RotaryEmbedding(16, 10000.0, None)
    x = torch.randn(5, 3, 16)  # [T, heads, head_dim]
    cos, sin = rope(torch.arange(5), torch.float32)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[0], x[0])


def test_scores_depend_only_on_relative_position() -> None:
    rope = RotaryEmbedding(16, 10000.0, None)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        cq, sq = rope(torch.tensor([pos_q]), torch.float32)
        ck, sk = rope(torch.tensor([pos_k]), torch.float32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-5, rtol=0)


def test_inv_freq_survives_a_dtype_cast() -> None:
    from kvabi.models import LlamaModel, ModelConfig

    model = LlamaModel(ModelConfig(96, 64, 128, 1, 4, 2, 16)).to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, scaled_inv_freq(16, 10000.0, None))
