"""Shards of a Llama model under the TP plan, run side by side in threads whose all-reduce
is a sum at a barrier: the logits equal the whole model's (fp32; the sum changes the
addition order, hence the tolerance). Heads that do not divide (9 query, 3 KV), KV heads
replicated (4 ranks), an MLP that splits unevenly, biases on q/k/v, o_proj and the MLP (kept
by rank 0 alone in the summed projections)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvabi.models.attention import ContiguousAttention
from kvabi.models.config import ModelConfig
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel
from kvabi.parallel.tp_plan import TPPlanError
from kvabi.parallel.tp_shard import llama_plan, shard_llama
from tests.engine.tiny import tiny_tokenizer


def loaded(bias: bool) -> LoadedModel:
    config = ModelConfig(
        vocab_size=257,
        hidden_size=72,
        intermediate_size=130,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=8,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bias,
    )
    torch.manual_seed(3)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
    return LoadedModel(config, model.eval(), tiny_tokenizer())


class ThreadSum:
    """An all-reduce for `size` threads: each adds its part, all read the sum in rank order."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def for_rank(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)  # type: ignore[arg-type]
            self.barrier.wait()  # every rank has read the parts before the next layer's
            return t.copy_(total)

        return reduce


def logits(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    attn = ContiguousAttention.for_config(model.config)
    with torch.inference_mode():
        return model.model(ids, torch.arange(len(ids)), attn)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_sum_to_the_whole_model(size: int, bias: bool) -> None:
    whole = loaded(bias)
    ids = torch.randint(0, 257, (11,), generator=torch.Generator().manual_seed(0))
    want = logits(whole, ids)
    plan, total = llama_plan(whole, size), ThreadSum(size)
    shards = [shard_llama(whole, plan, r, total.for_rank(r)) for r in range(size)]
    assert sum(s.config.num_heads for s in shards) == 9
    assert sum(s.config.intermediate_size for s in shards) == 130
    out: list[torch.Tensor | None] = [None] * size

    def run(rank: int) -> None:
        out[rank] = logits(shards[rank], ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in out:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_only_llama_family_models_shard() -> None:
    class Other:
        model = torch.nn.Linear(1, 1)

    with pytest.raises(TPPlanError, match="Llama-family"):
        llama_plan(Other(), 2)  # type: ignore[arg-type]
