"""One-pass re-blocking: the runs it plans (exact), and conversions through it against the
token-by-token path."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi import convert as convert_module
from kvabi.abi import reblock_plan as reblock_plan_module
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.reblock import plan_runs
from kvabi.native.cpu_kernels import cpu_kernels
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
    ("src", "s_bs", "dst", "d_bs", "dtype"),
    [
        ("vllm-flash-attn-hnd", 4, "vllm-flash-attn", 8, None),
        ("vllm-flash-attn", 8, "sglang-mha-hnd", 2, None),
        ("trtllm", 4, "vllm-flashinfer", 16, None),
        ("vllm-flash-attn-hnd", 4, "vllm-flash-attn", 8, "bf16"),
        ("vllm-flash-attn", 16, "vllm-cpu-vec", 32, "bf16"),  # K^T: transposing copies
        ("vllm-cpu-vec", 32, "vllm-flash-attn", 8, "bf16"),
        ("vllm-cpu-vec", 32, "vllm-flash-attn", 8, "f32"),
    ],
)
@pytest.mark.parametrize("planned", [True, False])
def test_one_pass_equals_token_by_token(src, s_bs, dst, d_bs, dtype, planned, monkeypatch):
    # one pass: copies worked out once per geometry (`ReblockPlan`) or view by view
    if not planned:
        monkeypatch.setattr(reblock_plan_module, "cpu_kernels", lambda: None)
    model = ModelSpec(tuple(LayerSpec(ATTN, 2, 16, 16) for _ in range(3)), "t")
    kw = {"dtype": dtype} if dtype else {}
    a = _filled(preset_descriptor(src, model, block_size=s_bs, **kw), 24, seed=1)
    dst_desc = preset_descriptor(dst, model, block_size=d_bs, **kw)
    n = 2 * max(s_bs, d_bs)  # whole blocks of both sizes: units of max(s_bs, d_bs) tokens
    r, units = max(s_bs, d_bs) // min(s_bs, d_bs), [1, 0, 3, 2][: n // max(s_bs, d_bs)]
    small = [u * r + i + 2 for u in units for i in range(r)]  # consecutive within each unit
    big = [5, 0, 3, 1][: len(units)]  # any blocks: runs only where they follow
    s_ids, d_ids = (small, big) if s_bs < d_bs else (big, small)
    args = dict(num_tokens=n, src_block_ids=s_ids, dst_block_ids=d_ids)
    fast = convert(a, dst_desc, **args, out=_filled(dst_desc, 24, seed=2))
    assert convert_module._reblock_runs([a], fast, n, s_ids, d_ids) is not None
    has_plan = reblock_plan_module.reblock_plan(a, fast) is not None
    kernels = cpu_kernels()
    transposes = "vllm-cpu-vec" in (src, dst)  # K^T against token-major blocks
    four_byte_transposes = transposes and dtype == "f32"  # no kernel for those
    slow_transposes = transposes and not (kernels and kernels.transposes_fast)
    expected = planned and kernels is not None and not four_byte_transposes and not slow_transposes
    assert has_plan == expected
    monkeypatch.setattr(convert_module, "_reblock_runs", lambda *_: None)
    slow = convert(a, dst_desc, **args, out=_filled(dst_desc, 24, seed=2))
    for key, t in slow.tensors.items():
        assert torch.equal(fast.tensors[key], t), key


@pytest.mark.parametrize("planned", [True, False])
def test_some_layers_move_and_the_others_stay(planned, monkeypatch):
    # a NIXL part's layers, converted while the next part is read: `layer_ids`
    if not planned:
        monkeypatch.setattr(reblock_plan_module, "cpu_kernels", lambda: None)
    model = ModelSpec(tuple(LayerSpec(ATTN, 2, 16, 16) for _ in range(3)), "t")
    a = _filled(preset_descriptor("vllm-flash-attn-hnd", model, block_size=4, dtype="bf16"), 8, 1)
    dst_desc = preset_descriptor("vllm-flash-attn", model, block_size=8, dtype="bf16")
    args = dict(num_tokens=16, src_block_ids=[4, 5, 0, 1], dst_block_ids=[3, 1])
    whole = convert(a, dst_desc, **args, out=_filled(dst_desc, 4, seed=2))
    part = convert(a, dst_desc, **args, out=_filled(dst_desc, 4, seed=2), layer_ids=[1])
    before = _filled(dst_desc, 4, seed=2)
    for key, t in part.tensors.items():
        layer = int(key.split(".")[0])
        assert torch.equal(t, (whole if layer == 1 else before).tensors[key]), key
