"""One-pass re-blocking: the runs it plans (exact), and conversions through it against the
token-by-token path."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi import convert as convert_module
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.reblock import plan_runs
from tests.abi.test_convert import _filled


def test_runs_merge_units_that_follow_on_both_sides():
    # blocks of 4 into blocks of 8: units of 8 tokens = 2 source blocks, 1 destination block
    assert plan_runs(4, 8, 32, [0, 1, 2, 3, 8, 9, 4, 5], [5, 6, 2, 3]) == [
        (0, 5, 2),
        (8, 2, 1),
        (4, 3, 1),
    ]
    assert plan_runs(8, 4, 16, [3, 7], [0, 1, 2, 3]) == [(3, 0, 1), (7, 2, 1)]
    assert plan_runs(4, 8, 16, [0, 2, 3, 4], [0, 1]) is None  # a unit's small blocks apart
    assert plan_runs(4, 8, 12, [0, 1, 2], [0, 1]) is None  # a partial unit
    assert plan_runs(4, 6, 12, [0, 1, 2], [0, 1]) is None  # sizes not multiples
    assert plan_runs(4, 4, 8, [0, 1], [0, 1]) is None  # same size: the direct path's


@pytest.mark.parametrize(
    ("src", "s_bs", "dst", "d_bs"),
    [
        ("vllm-flash-attn-hnd", 4, "vllm-flash-attn", 8),
        ("vllm-flash-attn", 8, "sglang-mha-hnd", 2),
        ("trtllm", 4, "vllm-flashinfer", 16),
    ],
)
def test_one_pass_equals_token_by_token(src, s_bs, dst, d_bs, monkeypatch):
    model = ModelSpec(tuple(LayerSpec(ATTN, 2, 8, 8) for _ in range(3)), "t")
    a = _filled(preset_descriptor(src, model, block_size=s_bs), 24, seed=1)
    dst_desc = preset_descriptor(dst, model, block_size=d_bs)
    n = 32  # whole blocks of both sizes: units of max(s_bs, d_bs) tokens
    r, units = max(s_bs, d_bs) // min(s_bs, d_bs), [1, 0, 3, 2][: n // max(s_bs, d_bs)]
    small = [u * r + i + 2 for u in units for i in range(r)]  # consecutive within each unit
    big = [5, 0, 3, 1][: len(units)]  # any blocks: runs only where they follow
    s_ids, d_ids = (small, big) if s_bs < d_bs else (big, small)
    args = dict(num_tokens=n, src_block_ids=s_ids, dst_block_ids=d_ids)
    fast = convert(a, dst_desc, **args, out=_filled(dst_desc, 24, seed=2))
    assert convert_module._reblock_runs([a], fast, n, s_ids, d_ids) is not None
    monkeypatch.setattr(convert_module, "_reblock_runs", lambda *_: None)
    slow = convert(a, dst_desc, **args, out=_filled(dst_desc, 24, seed=2))
    for key, t in slow.tensors.items():
        assert torch.equal(fast.tensors[key], t), key
