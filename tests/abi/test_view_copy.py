"""`CopyPlan`: whole-cache conversions between layouts of the same values as one C++ call over
offsets worked out once per geometry, against the view-by-view `copy_` path it replaces."""

import pytest
import torch

from kvabi.abi import convert as convert_module
from kvabi.abi import reblock_plan as reblock_plan_module
from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.catalog import catalog_model
from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.view_copy import TO_E4M3, TO_INT8_ROWS, CopyPlan, RowOp, _spec, transpose_spec
from kvabi.native.cpu_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ kernels here")
MODEL = catalog_model("smollm2-135m")
PAIRS = [
    ("vllm-flash-attn", "vllm-flash-attn-hnd"),
    ("vllm-flash-attn", "vllm-flashinfer"),
    ("vllm-flash-attn", "vllm-lbnhc"),
    ("vllm-flashinfer-hnd", "vllm-lbhnc"),
    ("vllm-flash-attn", "vllm-flash-attn-xl-hnd"),
    ("vllm-flash-attn", "trtllm"),
]


def _random(name: str, blocks: int, seed: int) -> CacheBuffers:
    desc = preset_descriptor(name, MODEL, block_size=16)
    gen = torch.Generator().manual_seed(seed)
    tensors = allocate(desc, blocks)
    return CacheBuffers(desc, {k: torch.randn(v.shape, generator=gen).to(v.dtype)
                               for k, v in tensors.items()})  # fmt: skip


def _reference(src: CacheBuffers, dst_name: str, monkeypatch) -> CacheBuffers:
    with monkeypatch.context() as m:
        m.setattr(convert_module, "_run_plan", lambda *_: False)  # view by view
        return convert(src, preset_descriptor(dst_name, MODEL, block_size=16))


@pytest.mark.parametrize(("src_name", "dst_name"), PAIRS)
def test_a_plan_equals_the_view_by_view_copy_and_serves_other_buffers(
    src_name, dst_name, monkeypatch
):
    runs = []
    calls = cpu_kernels().copy_views
    monkeypatch.setattr(type(cpu_kernels()), "copy_views", lambda k, s: (runs.append(1), calls(s)))
    dst_desc = preset_descriptor(dst_name, MODEL, block_size=16)
    convert_module._PLANS.clear()
    for seed in (1, 2):  # the second conversion reuses the first's plan on other buffers
        src = _random(src_name, 5, seed)
        got, want = convert(src, dst_desc), _reference(src, dst_name, monkeypatch)
        assert got.tensors.keys() == want.tensors.keys()
        for key, t in want.tensors.items():
            assert torch.equal(got.tensors[key], t), (seed, key)
    assert len(runs) == 2 and len(convert_module._PLANS) == 1
    # and into a given destination whose buffers are laid out alike
    out = CacheBuffers.empty(dst_desc, 5)
    src = _random(src_name, 5, 3)
    convert(src, dst_desc, out=out)
    want = _reference(src, dst_name, monkeypatch)
    assert all(torch.equal(out.tensors[k], t) for k, t in want.tensors.items())


def test_copies_it_cannot_take_give_no_plan():
    a, b = torch.zeros(4, 8, 16), torch.zeros(4, 8, 16)
    assert CopyPlan.build([(a, b.double())], {"a": a}, {"b": b}) is None  # dtypes differ
    assert (
        CopyPlan.build([(a, b.transpose(1, 2).contiguous().transpose(1, 2))], {"a": a}, {"b": b})
        is None
    )  # fmt: skip (innermost not contiguous)
    assert CopyPlan.build([(a, torch.zeros(4, 8, 16))], {"a": a}, {"b": b}) is None  # elsewhere


def test_contiguous_dims_merge_into_rows():
    a, b = torch.zeros(4, 8, 16), torch.zeros(4, 8, 16)
    spec = _spec(a, b)  # all contiguous in both: one row of the whole tensor
    assert spec[2] == 1 and spec[3] == 1 and spec[-3] == a.numel() * 4
    spec = _spec(a.permute(1, 0, 2), b.permute(1, 0, 2).contiguous())  # two outer dims left
    assert spec[2] == 2 and spec[3:5] == [8, 4] and spec[-3] == 16 * 4
    src = torch.zeros(4, 8, 16, dtype=torch.bfloat16)  # fp8 with one scale: rows merge too
    spec = _spec(torch.zeros(4, 8, 16, dtype=torch.uint8), src, RowOp(TO_E4M3))
    assert spec[2] == 1 and spec[-3] == 4 * 8 * 16  # a row of values, not bytes
    spec = _spec(torch.zeros(4, 8, 20, dtype=torch.int8), src, RowOp(TO_INT8_ROWS))
    assert spec[2] == 1 and spec[3] == 32 and spec[-3] == 16  # 32 rows: a scale per token-head


@pytest.mark.parametrize(
    ("dst_name", "overrides"),
    [
        ("vllm-fp8", {"scales": ()}),
        ("vllm-fp8", {"scales": tuple(0.5 + 0.037 * i for i in range(60))}),
        ("vllm-int8-per-token-head", {}),
        ("vllm-flash-attn-hnd", {"dtype": "f32"}),
    ],
)
def test_quantising_rows_equal_the_codec_bit_for_bit(dst_name, overrides, monkeypatch):
    # values spread over e4m3's normal and subnormal ranges and past its 448 saturation, and
    # a (token, head) row of zeros (int8's scale 1)
    src = _random("vllm-flash-attn", 3, 7)
    key = next(iter(src.tensors))
    t = src.tensors[key]
    t.mul_(torch.logspace(-9, 3, t.shape[-1]).to(t.dtype))
    t[0, 0, 0, 0].zero_()
    dst_desc = preset_descriptor(dst_name, MODEL, block_size=16, **overrides)
    runs = []
    calls = cpu_kernels().copy_views
    monkeypatch.setattr(type(cpu_kernels()), "copy_views", lambda k, s: (runs.append(1), calls(s)))
    got = convert(src, dst_desc)
    assert runs == [1]  # the plan ran
    with monkeypatch.context() as m:
        m.setattr(convert_module, "_run_plan", lambda *_: False)  # plane by plane in torch
        want = convert(src, dst_desc)
    for k, w in want.tensors.items():
        assert torch.equal(got.tensors[k].view(torch.uint8), w.view(torch.uint8)), k


@pytest.mark.parametrize(
    ("src_name", "overrides"),
    [
        ("vllm-fp8", {"scales": ()}),
        ("vllm-fp8", {"scales": tuple(0.5 + 0.037 * i for i in range(60))}),
        ("vllm-int8-per-token-head", {}),
    ],
)
def test_rows_back_to_bf16_equal_the_codec_bit_for_bit(src_name, overrides, monkeypatch):
    # quantised rows (made by the torch codec from values over e4m3's whole range, a zero row
    # among them) back into bf16: by the plan in one kernel call, and plane by plane in torch
    values = _random("vllm-flash-attn", 3, 11)
    t = next(iter(values.tensors.values()))
    t.mul_(torch.logspace(-9, 3, t.shape[-1]).to(t.dtype))
    t[0, 0, 0, 0].zero_()
    src_desc = preset_descriptor(src_name, MODEL, block_size=16, **overrides)
    with monkeypatch.context() as m:
        m.setattr(convert_module, "_run_plan", lambda *_: False)
        src = convert(values, src_desc)
        want = convert(src, values.desc)
    runs = []
    calls = cpu_kernels().copy_views
    monkeypatch.setattr(type(cpu_kernels()), "copy_views", lambda k, s: (runs.append(1), calls(s)))
    got = convert(src, values.desc)
    assert runs == [1]  # the plan ran
    for k, w in want.tensors.items():
        assert torch.equal(got.tensors[k].view(torch.int16), w.view(torch.int16)), k


# ---- transposing copies (vLLM CPU's K^T [D][N] against token-major blocks) ----


@pytest.mark.parametrize("tokens,dim", [(16, 64), (128, 64), (16, 32), (16, 48), (20, 40), (7, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_transposing_copy_is_torchs_both_ways(isa_kernels, tokens, dim, dtype):
    # token-major [blocks, tokens, heads, dim] against [blocks, heads, dim, tokens]: the
    # tiles of 16 x 32 and 16 x 16 in vector registers, and the element-wise rest
    gen = torch.Generator().manual_seed(tokens * dim)
    major = torch.randn(3, tokens, 2, dim, generator=gen).to(dtype)
    minor = torch.zeros(3, 2, dim, tokens, dtype=dtype)
    want = minor.clone()
    want.permute(0, 3, 1, 2).copy_(major)
    spec = transpose_spec(minor.permute(0, 3, 1, 2), major)
    assert spec is not None
    isa_kernels.transpose_views(torch.tensor([spec], dtype=torch.int64))
    assert torch.equal(minor, want)
    back = torch.zeros_like(major)
    spec = transpose_spec(back, minor.permute(0, 3, 1, 2))
    isa_kernels.transpose_views(torch.tensor([spec], dtype=torch.int64))
    assert torch.equal(back, major)


def test_only_copies_that_transpose_two_byte_elements_get_a_transposing_spec():
    a = torch.zeros(4, 16, 8, dtype=torch.bfloat16)
    assert transpose_spec(a, torch.zeros_like(a)) is None  # the same axis contiguous: rows
    t = torch.zeros(4, 8, 16, dtype=torch.bfloat16).transpose(1, 2)
    assert transpose_spec(t, a) is not None
    assert transpose_spec(t.float(), a.float()) is None  # 4-byte elements: torch's copy
    assert transpose_spec(t, a[:, :8]) is None  # shapes differ
    six = torch.zeros(2, 2, 2, 2, 2, 2, 2, dtype=torch.bfloat16)
    assert transpose_spec(six.transpose(5, 6), six) is None  # more outer dims than a spec holds


def test_a_reblocking_load_into_vllm_cpu_blocks_is_the_torch_copys(monkeypatch):
    # 16-token NHD blocks into vLLM CPU's 128-token blocks (K^T) and back, through `convert`
    src = _random("vllm-flash-attn", 16, seed=3)
    vec = preset_descriptor("vllm-cpu-vec", MODEL, dtype="bf16", block_size=128)
    table = [5, 2]
    with monkeypatch.context() as m:  # torch's copies, view by view
        m.setattr(reblock_plan_module, "cpu_kernels", lambda: None)
        want = convert(src, vec, num_tokens=256, dst_block_ids=table,
                       out=CacheBuffers.empty(vec, 6, "zeros"))  # fmt: skip
    got = convert(src, vec, num_tokens=256, dst_block_ids=table,
                  out=CacheBuffers.empty(vec, 6, "zeros"))  # fmt: skip
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    back = convert(got, src.desc, num_tokens=256, src_block_ids=table)
    assert all(torch.equal(back.tensors[k], src.tensors[k]) for k in src.tensors)
