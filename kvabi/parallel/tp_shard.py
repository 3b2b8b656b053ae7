"""One rank's shard of a Llama-family model under a TP plan (kvabi/parallel/tp_plan.py).

The shard is a `LlamaModel` of its own config (its query and KV head counts, its MLP columns)
built from slices of the full weights: q/k/v rows of its heads, o_proj columns of its query
heads, gate/up rows and down_proj columns of its MLP columns; norms, embeddings and the LM
head whole. Its attention output and MLP down projections end in `reduce` (the all-reduce),
and a bias there is kept by rank 0 alone, so the sum adds it once.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvabi.models.llama import LlamaModel, Reduce
from kvabi.models.registry import LoadedModel
from kvabi.parallel.tp_plan import TPPlan, TPPlanError, plan_tp


def llama_plan(loaded: LoadedModel, size: int) -> TPPlan:
    """The TP plan of a Llama-family model (TPPlanError for any other model)."""
    if not isinstance(loaded.model, LlamaModel):
        raise TPPlanError(
            f"tp: tensor parallelism runs Llama-family models; not {type(loaded.model).__name__}"
        )
    c = loaded.config
    return plan_tp(c.num_heads, c.kv_layers(), c.intermediate_size, size)


def shard_llama(loaded: LoadedModel, plan: TPPlan, rank: int, reduce: Reduce) -> LoadedModel:
    """Rank `rank`'s shard of `loaded` (every layer's shard is alike in a Llama model)."""
    shard = plan.layers[0][rank]
    if any(layer[rank] != shard for layer in plan.layers):
        raise TPPlanError("tp: a Llama model shards every layer alike")
    c = loaded.config
    hd, (m0, m1) = c.head_dim, plan.mlp[rank]
    q = slice(shard.q_start * hd, shard.q_stop * hd)
    kv = slice(shard.kv_start * hd, shard.kv_stop * hd)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": slice(m0, m1)}
    rows["up_proj"] = rows["gate_proj"]
    cols = {"o_proj": q, "down_proj": slice(m0, m1)}
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.model.state_dict().items():
        part = name.split(".")[-2] if name.startswith("layers.") else ""
        is_bias = name.endswith(".bias")
        if part in rows:
            tensor = tensor[rows[part]]
        elif part in cols and not is_bias:
            tensor = tensor[:, cols[part]]
        elif part in cols and rank != 0:  # the sum adds rank 0's bias once
            tensor = torch.zeros_like(tensor)
        weights[name] = tensor.clone()
    config = replace(
        c,
        num_heads=shard.num_heads,
        num_kv_heads=shard.num_kv_heads,
        intermediate_size=m1 - m0,
    )
    model = LlamaModel.from_state_dict(config, weights)
    for layer in model.layers:
        layer.self_attn.reduce = layer.mlp.reduce = reduce
    return LoadedModel(config, model, loaded.tokenizer)
