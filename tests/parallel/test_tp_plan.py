"""The TP plan against an independent check of what a plan must be: every query head on
exactly one rank, each rank's query heads reading only KV heads it holds (GQA groups), KV
heads replicated exactly where there are fewer than ranks, MLP columns covered once; and the
refusals."""

from __future__ import annotations

import pytest

from kvabi.abi.descriptor import ATTN, MLA, LayerSpec
from kvabi.parallel.tp_plan import TPPlanError, even_split, plan_tp


def attn(kv: int) -> LayerSpec:
    return LayerSpec(ATTN, kv, 64, 64)


def check(plan, num_heads: int, kv: int, inter: int) -> None:
    group = num_heads // kv
    for layer in plan.layers:
        owners = [r for r, s in enumerate(layer) for _ in range(s.q_start, s.q_stop)]
        assert sorted(h for s in layer for h in range(s.q_start, s.q_stop)) == list(
            range(num_heads)
        )
        assert len(owners) == num_heads  # no head twice
        for s in layer:
            assert s.num_heads >= 1
            needed = {h // group for h in range(s.q_start, s.q_stop)}
            assert needed <= set(range(s.kv_start, s.kv_stop))
            holders = sum(1 for o in layer if o.kv_start <= s.kv_start < o.kv_stop)
            assert s.replicated == (holders > 1)
    cols = [c for a, b in plan.mlp for c in range(a, b)]
    assert cols == list(range(inter))


@pytest.mark.parametrize(
    "heads,kv,size",
    [(9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 4), (9, 3, 9), (4, 1, 2), (4, 1, 3), (32, 8, 3)],
)
def test_plans_hold_every_head_once_with_its_kv(heads, kv, size):
    plan = plan_tp(heads, (attn(kv),) * 2, 1536, size)
    assert plan.size == size and len(plan.layers) == 2
    check(plan, heads, kv, 1536)


def test_smollm2_shapes():
    """9 query and 3 KV heads: 2 ranks split the KV heads 2 + 1 with their groups; 4 ranks
    replicate KV head 0 on ranks 0 and 1, which split its 3 query heads 2 + 1."""
    two = plan_tp(9, (attn(3),), 1536, 2).layers[0]
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop) for s in two] == [
        (0, 6, 0, 2),
        (6, 9, 2, 3),
    ]
    four = plan_tp(9, (attn(3),), 1536, 4).layers[0]
    assert [(s.q_start, s.q_stop, s.kv_start) for s in four] == [
        (0, 2, 0), (2, 3, 0), (3, 6, 1), (6, 9, 2)
    ]  # fmt: skip
    assert [s.replicated for s in four] == [True, True, False, False]
    assert plan_tp(9, (attn(3),), 1536, 3).mlp == ((0, 512), (512, 1024), (1024, 1536))


def test_per_layer_heads_and_mla():
    """Heads that vary by layer (Laguna) get a shard each; an MLA latent is replicated."""
    mla = LayerSpec(MLA, latent_dim=512, rope_dim=64)
    plan = plan_tp((8, 4, 16), (attn(2), attn(4), mla), 100, 2)
    check_layers = plan.layers
    assert [s.num_heads for s in check_layers[0]] == [4, 4]
    assert [(s.kv_start, s.kv_stop) for s in check_layers[1]] == [(0, 2), (2, 4)]
    assert all(s.replicated and s.num_kv_heads == 1 for s in check_layers[2])
    assert [s.num_heads for s in check_layers[2]] == [8, 8]
    assert plan.rank_heads(1)[2].q_start == 8
    assert even_split(5, 3) == ((0, 2), (2, 4), (4, 5))


def test_plans_that_cannot_be_are_refused():
    with pytest.raises(TPPlanError, match="query heads cannot be spread"):
        plan_tp(2, (attn(1),), 64, 3)
    with pytest.raises(TPPlanError, match="cannot be spread"):
        plan_tp(9, (attn(9),), 64, 10)  # 9 heads, 10 ranks
    with pytest.raises(TPPlanError, match="MLP"):
        plan_tp(4, (attn(2),), 1, 2)
    with pytest.raises(TPPlanError, match=">= 1"):
        plan_tp(4, (attn(2),), 64, 0)


def test_kvabi_plan_prints_the_tp_plan_and_each_ranks_kv(capsys):
    """SmolLM2 (30 layers of 3 KV heads of 64, bf16: 23,040 B per token) over 2 ranks: rank 0
    caches 2 KV heads (15,360 B/token), rank 1 one (7,680); Llama 3 70B's 8 KV heads over 3."""
    from kvabi.cli.main import main

    assert main(["plan", "--model", "smollm2-135m", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Tensor-parallel plan over 2 ranks" in out
    assert "0-29       0     0..5      0..1             no" in out
    assert "15360" in out and "7680" in out
    assert main(["plan", "--model", "llama-3-70b", "--tp", "3"]) == 0
    out = capsys.readouterr().out
    assert "0..23      0..2" in out and "48..63      6..7" in out
