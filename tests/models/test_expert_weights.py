"""Per-expert checkpoint weights -> the 3D expert tensors, exactly as transformers merges them."""

from __future__ import annotations

import pytest
import torch

from kvabi.models.expert_weights import merge_expert_weights


def _experts(num_experts: int) -> dict[str, torch.Tensor]:
    sd = {}
    for e in range(num_experts):
        for i, kind in enumerate(("gate_proj", "up_proj", "down_proj")):
            sd[f"layers.1.mlp.experts.{e}.{kind}.weight"] = torch.full((2, 3), 10.0 * e + i)
    return sd


def test_experts_stack_gate_then_up() -> None:
    other = {"layers.1.mlp.gate.weight": torch.zeros(2, 3)}
    merged = merge_expert_weights(other | _experts(2))
    assert sorted(merged) == [
        "layers.1.mlp.experts.down_proj",
        "layers.1.mlp.experts.gate_up_proj",
        "layers.1.mlp.gate.weight",
    ]
    gate_up = merged["layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (2, 4, 3)
    assert gate_up[:, :, 0].tolist() == [[0, 0, 1, 1], [10, 10, 11, 11]]
    assert merged["layers.1.mlp.experts.down_proj"][:, 0, 0].tolist() == [2, 12]


def test_gaps_and_missing_parts_raise() -> None:
    sd = _experts(3)
    del sd["layers.1.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj: experts \\[0, 2\\]"):
        merge_expert_weights(sd)
    sd = {k: v for k, v in _experts(2).items() if "down_proj" not in k}
    with pytest.raises(ValueError, match="down_proj"):
        merge_expert_weights(sd)
