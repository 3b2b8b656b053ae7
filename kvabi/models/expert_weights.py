"""MoE checkpoints keep one module per expert; the models keep the experts as 3D tensors.

`merge_expert_weights` turns `<p>.experts.<e>.{gate,up,down}_proj.weight` (the qwen2_moe-style
layout that Laguna checkpoints use, and transformers' `save_pretrained` writes back) into
`<p>.experts.gate_up_proj` [E, 2 * inner, hidden] (gate rows, then up rows) and
`<p>.experts.down_proj` [E, hidden, inner], as transformers' `MergeModulelist(dim=0)` and
`Concatenate(dim=1)` do when it loads them.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_KINDS = ("gate_proj", "up_proj", "down_proj")


def merge_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights stacked into 3D tensors; every other entry unchanged."""
    merged: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        match = _EXPERT.match(name)
        if match is None:
            merged[name] = tensor
        else:
            groups.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = tensor
    for prefix, kinds in groups.items():
        stacked = {kind: _stack(prefix, kind, kinds.get(kind, {})) for kind in _KINDS}
        if len({t.shape[0] for t in stacked.values()}) != 1:
            raise ValueError(f"{prefix}: gate, up and down cover different numbers of experts")
        gate_up = torch.cat((stacked["gate_proj"], stacked["up_proj"]), dim=1)
        merged[f"{prefix}.gate_up_proj"] = gate_up  # [E, 2 * inner, hidden]
        merged[f"{prefix}.down_proj"] = stacked["down_proj"]  # [E, hidden, inner]
    return merged


def _stack(prefix: str, kind: str, experts: dict[int, torch.Tensor]) -> torch.Tensor:
    if sorted(experts) != list(range(len(experts))) or not experts:
        raise ValueError(f"{prefix}.*.{kind}: experts {sorted(experts)} are not 0..n-1")
    return torch.stack([experts[e] for e in range(len(experts))])
