"""Each fused CPU kernel against its plain-torch reference (the path the model takes without it).

Every test runs on the kernels built for each ISA target this CPU can run (`ISA_TARGETS`): the
CPU's own (`native`: AMX where it has it), AVX512-BF16 without AMX, and AVX2 (x86-64-v3, no
AVX-512), so the paths another CPU kind takes are tested here too; a target the CPU lacks is
skipped with the flag it misses."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvabi.models.llama import RMSNorm
from kvabi.models.rope import apply_rope
from kvabi.native.cpu_kernels import (
    ISA_TARGETS,
    cpu_kernels,
    isa_gap,
    kernel_status,
    limit_threads,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=list(ISA_TARGETS))
def kernels(request):
    # The suite runs where a C++ compiler exists (llama-cpp-python is built from source too);
    # a build failure here is a defect, not a reason to fall back silently.
    if (why := isa_gap(request.param)) is not None:
        pytest.skip(f"kernels for {request.param}: {why}")
    k = cpu_kernels(request.param)
    assert k is not None, kernel_status()
    return k


def test_each_isa_build_has_the_paths_its_isa_gives():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    native = cpu_kernels("native")
    assert native is not None and native.isa == "native"
    if "amx_bf16" in flags and "amx_tile" in flags:
        assert native.gemm == "AMX tiles" and native.amx
    elif "avx512_bf16" in flags:
        assert native.gemm == "AVX512-BF16 dot products" and not native.amx
    if isa_gap("avx512-bf16") is None:
        k = cpu_kernels("avx512-bf16")
        assert k.gemm == "AVX512-BF16 dot products" and not k.amx
        assert k.paged_decode_variant(torch.bfloat16, 64, 3) == "AVX512-BF16 instance"
    if isa_gap("avx512") is None:
        k = cpu_kernels("avx512")  # AVX-512 without BF16 (Skylake-X to Ice Lake): it builds,
        assert k.gemm is None and not k.amx  # with no packed GEMM; AVX-512 copies and hashes
        assert k.paged_decode_variant(torch.bfloat16, 64, 3) == "generic loop, head_dim unrolled"
        assert k.transposes_fast
    if isa_gap("avx2") is None:
        k = cpu_kernels("avx2")  # no AVX-512: no packed GEMM, the generic decode loops
        assert k.gemm is None and not k.amx
        assert k.paged_decode_variant(torch.bfloat16, 64, 3) == "generic loop, head_dim unrolled"
        with pytest.raises(RuntimeError, match="code -2"):
            k.gemm_linear(
                torch.randn(1, 32).bfloat16(), k.gemm_pack(torch.randn(16, 32).bfloat16()), None
            )
    assert "unknown ISA target" in isa_gap("avx9")


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: the kernels reproduce torch's roundings op by op, so the bits agree on any CPU;
    float32: FMA contraction and summation order differ, within a few ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def check_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """As `check`, except that a bf16 element may be one ulp off: the float32 sum of squares
    is reduced in another order than torch's (each picks its vector width for the CPU), so
    it may differ in its last bit, and a value that lands next to a bf16 rounding boundary
    then rounds to the neighbour. Rare: at most 1% of the elements."""
    if got.dtype != torch.bfloat16:
        return check(got, want)
    assert got.shape == want.shape and want.dtype == torch.bfloat16
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()  # same signs
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01


def torch_decode(q, k, v, tables, lens):
    """The padded gather + SDPA path of the `batched` backend, in float32."""
    block_size = k.shape[1]
    kk, vv = k[tables].flatten(1, 2).float(), v[tables].flatten(1, 2).float()  # [S, L, Hkv, D]
    mask = torch.arange(tables.shape[1] * block_size)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2),
        kk.transpose(1, 2),
        vv.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        enable_gqa=True,
    )
    return out.squeeze(2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "dim"),
    # the bf16 AVX-512 paths take head sizes 64/128 with up to 8 (scores) and 4 or 2 (weighted
    # sum) query heads per KV head; the rest goes through the generic loops
    [
        (9, 3, 16, 64),
        (4, 4, 1, 32),
        (8, 2, 5, 128),
        (4, 2, 16, 128),
        (8, 1, 16, 64),
        (18, 1, 4, 64),
    ],
)
def test_paged_decode_equals_the_torch_path(
    kernels, dtype, layout, heads, kv_heads, block_size, dim
):
    gen = torch.Generator().manual_seed(heads * block_size)
    num_blocks = 40
    if layout == "nhd":  # K and V on a leading axis, canonical [block, slot, head, dim] views
        kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
        k, v = kv[0], kv[1]
    else:
        kv = torch.randn(2, num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size, 7])
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    assert kernels.paged_decode_supports(q, k, v)
    got = kernels.paged_decode(q, k, v, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    want = torch_decode(q, k, v, tables, lens)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:  # the float32 result rounded once to bf16, within an ulp of torch's rounding
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("lens", [[600], [600, 77], [130, 129, 1]])
def test_paged_decode_splits_few_long_sequences_into_parts_and_merges_them(kernels, threads, lens):
    # Batch 1 has as many items as KV heads (3 here): on several threads the bf16 decode splits
    # each item's keys into parts and merges their softmax sums. Blocks a table does not name and
    # slots past each context hold NaN: a part reading outside its range would show.
    gen = torch.Generator().manual_seed(len(lens) * threads)
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 100
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    lens = torch.tensor(lens)
    width = int(-(-lens.max() // block_size))
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([order[i * width : (i + 1) * width] for i in range(len(lens))])
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        used.view(-1, block_size)[tables[s]] |= (torch.arange(width * block_size) < n).view(
            width, block_size
        )
    poisoned = kv.clone()
    poisoned[:, ~used] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=gen).bfloat16()
    with limit_threads(threads):
        parts = kernels.attend_parts(len(lens) * kv_heads, int(lens.max()))
        got = kernels.paged_decode(q, poisoned[0], poisoned[1], tables, lens)
    assert (parts > 1) == (threads > 1 and len(lens) * kv_heads < 4 * threads)
    assert torch.isfinite(got.float()).all()
    want = torch_decode(q, kv[0], kv[1], tables, lens)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


def test_paged_decode_never_reads_past_the_context(kernels):
    # Table entries past a sequence's context point at a block full of NaN: a read would show.
    k = torch.randn(4, 4, 1, 8)
    v = torch.randn(4, 4, 1, 8)
    k[3], v[3] = float("nan"), float("nan")
    k[0, 2:], v[0, 2:] = float("nan"), float("nan")  # slots after the context in its last block
    tables = torch.tensor([[1, 0, 3]])
    out = kernels.paged_decode(torch.randn(1, 2, 8), k, v, tables, torch.tensor([6]))
    assert torch.isfinite(out).all()


def test_paged_decode_refuses_what_it_cannot_read(kernels):
    q = torch.randn(2, 4, 8)
    k = torch.randn(3, 4, 2, 8)
    assert not kernels.paged_decode_supports(q.half(), k.half(), k.half())  # fp16: torch path
    assert not kernels.paged_decode_supports(q, k, k.transpose(0, 1))  # strides differ
    assert not kernels.paged_decode_supports(torch.randn(2, 3, 8), k, k)  # 3 heads on 2 KV heads


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_fused_residual_add_equal_hf_rmsnorm(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(7, 96, generator=gen).to(dtype) * 3 for _ in range(2))
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    with torch.inference_mode():
        check_norm(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
        updated = residual.clone()
        got = kernels.rms_norm(x, norm.weight, norm.eps, residual=updated)
        assert torch.equal(updated, residual + x)  # the residual stream: one add, exact
        check_norm(got, norm(residual + x))
        strided = torch.randn(7, 200, generator=gen).to(dtype)[:, 10:106]  # a row-strided input
        check_norm(kernels.rms_norm(strided, norm.weight, norm.eps), norm(strided))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(kernels, dtype):
    gate_up = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(2)).to(dtype) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = kernels.silu_and_mul(gate_up), F.silu(gate) * up
    if dtype == torch.bfloat16:  # exp differs from libm's by an ulp of float32: rare bf16 flips
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)
    else:
        check(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_equals_apply_rope_on_a_strided_qkv_slice(kernels, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim = 6, 5, 16
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen).to(dtype)  # q|k rotated, v not
    cos, sin = (torch.randn(tokens, dim, generator=gen).to(dtype) for _ in range(2))
    want = apply_rope(qkv[:, : heads * dim].reshape(tokens, heads, dim), cos, sin)
    v_before = qkv[:, heads * dim :].clone()
    kernels.rope_(qkv[:, : heads * dim].view(tokens, heads, dim), cos, sin)
    check(qkv[:, : heads * dim].reshape(tokens, heads, dim), want)
    assert torch.equal(qkv[:, heads * dim :], v_before)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rope_(torch.randn(4, 3, 8).transpose(0, 1), cos[:3, :8], sin[:3, :8])


def _onednn_linear(x, weight, bias):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (96, 32), (960, 576), (576, 1536)])
def test_packed_gemm_matches_onednn(kernels, bias, n, k):
    # 48 = three column tiles: the odd one out runs alone; rows cross the 16- and 32-row tiles
    # of the AMX GEMM and the 8-row passes of the AVX512-BF16 one
    if kernels.gemm is None:
        pytest.skip(f"no packed GEMM in the {kernels.isa} build (no AMX, no AVX512-BF16)")
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k) * 0.05).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = kernels.gemm_pack(weight)
    for rows in (1, 5, 8, 9, 16, 17, 32, 33, 70):
        x = torch.randn(rows, k).bfloat16()
        got = kernels.gemm_linear(x, packed, b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        onednn = _onednn_linear(x, weight, b)
        if kernels.amx and rows <= 32:  # decode sizes: the same tile sums in the same order
            assert torch.equal(got, onednn)
        else:  # another summation order: a rare element rounds the other way, or (near a
            # cancellation, where a bf16 ulp is tiny) sits a float32 sum's error away
            assert (got != onednn).float().mean().item() < 1e-3
            scale = onednn.float().abs().max().item()
            torch.testing.assert_close(got, onednn, atol=1e-4 * scale, rtol=2**-7)  # one ulp
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())

        torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=0)


def test_packed_gemm_reads_strided_rows_and_refuses_odd_sizes(kernels):
    if kernels.gemm is None:
        pytest.skip(f"no packed GEMM in the {kernels.isa} build")
    weight = torch.randn(32, 64).bfloat16()
    wide = torch.randn(3, 128).bfloat16()
    x = wide[:, :64]  # row stride 128
    packed = kernels.gemm_pack(weight)
    assert torch.equal(kernels.gemm_linear(x, packed, None),
                       kernels.gemm_linear(x.contiguous(), packed, None))  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):  # x narrower than the weight
        kernels.gemm_linear(torch.randn(3, 32).bfloat16(), kernels.gemm_pack(weight), None)
    assert not kernels.gemm_supports(torch.randn(33, 64).bfloat16())

    assert not kernels.gemm_supports(torch.randn(32, 40).bfloat16())
    assert not kernels.gemm_supports(torch.randn(32, 64))


def _causal_reference(q, k, v):
    """float32 SDPA of the chunk's queries (the last tq positions) over all tk keys."""
    tq, tk = q.shape[0], k.shape[0]
    mask = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None].float() for t in (q, k, v)), attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("tq", "tk", "heads", "kv_heads", "dim"),
    [(150, 150, 9, 3, 64), (1, 1, 9, 3, 64), (17, 40, 9, 3, 64), (33, 33, 4, 4, 128),
     (100, 300, 8, 2, 64), (16, 16, 2, 1, 32), (31, 47, 6, 3, 64)],
)  # fmt: skip
def test_prefill_attention_matches_sdpa(kernels, tq, tk, heads, kv_heads, dim):
    if kernels.gemm is None:
        pytest.skip(f"no prefill attention kernel in the {kernels.isa} build")
    torch.manual_seed(tq * 1000 + tk)
    # q, k, v as the model hands them over: views into one fused qkv row per token
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tk, width).bfloat16()
    q = qkv[tk - tq :, : heads * dim].reshape(tq, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tk, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(tk, kv_heads, dim)
    assert kernels.prefill_supports(q, k, v)
    got = kernels.prefill_attention(q, k, v)
    assert got.shape == (tq, heads, dim) and got.dtype == torch.bfloat16
    want = _causal_reference(q, k, v)
    # torch's own bf16 flash attention on the same inputs sets the scale of the error
    mask = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    bf16 = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, enable_gqa=True
    )[0].transpose(0, 1)
    torch_err = (bf16.float() - want).abs().max().item()
    assert (got.float() - want).abs().max().item() <= 1.5 * torch_err + 1e-3


def test_prefill_attention_declines_what_it_cannot_take(kernels):
    if kernels.gemm is None:
        q, k = torch.randn(4, 2, 64).bfloat16(), torch.randn(8, 1, 64).bfloat16()
        assert kernels.prefill_gap(q, k, k) == "neither AMX nor AVX512-BF16"
        return
    q, k = torch.randn(4, 2, 64).bfloat16(), torch.randn(8, 1, 64).bfloat16()
    assert kernels.prefill_supports(q, k, k)
    assert not kernels.prefill_supports(q.float(), k.float(), k.float())
    assert not kernels.prefill_supports(torch.randn(4, 2, 48).bfloat16(), k[..., :48], k[..., :48])
    assert not kernels.prefill_supports(torch.randn(9, 2, 64).bfloat16(), k, k)  # tq > tk
    assert not kernels.prefill_supports(q.transpose(0, 1).contiguous().transpose(0, 1), k, k)


@pytest.mark.parametrize("heads", [1, 16])
def test_mla_decode_over_fp8_ds_mla_records_equals_the_torch_path(kernels, heads):
    """The C++ kernel reads 656-byte records in place (fp8 latents dequantised per 128-value
    tile, bf16 rope) and equals dequantise-then-SDPA (kvabi/abi/ds_mla_record.py, the torch
    reference the engine's other backends run) within float32 summation order. The pool holds
    an all-zero token (scale FLT_MIN) and a saturated one; tables are shuffled, lengths ragged,
    and the blocks past a sequence's length hold NaN records that must never be read."""
    from kvabi.abi.ds_mla_record import ds_mla_records_to_latent_rope, encode_records

    g = torch.Generator().manual_seed(3)
    num_blocks, bs = 7, 4
    values = torch.randn(num_blocks, bs, 1, 576, generator=g).bfloat16().float()
    values[0, 1] = 0.0
    values[0, 2, 0, :128] *= 1e4  # a tile whose large values set its scale
    records = encode_records(values)
    records[6] = 0xFF  # e4m3fn NaN codes and NaN scales: unreachable through the tables
    tables = torch.tensor([[3, 0, 5, 6], [1, 2, 4, 6], [0, 6, 6, 6]], dtype=torch.long)
    lens = torch.tensor([11, 12, 3])
    q = torch.randn(3, heads, 576, generator=g)
    got = kernels.mla_decode_records(q, records, tables, lens)
    latent, rope = ds_mla_records_to_latent_rope(records)
    keys = torch.cat((latent, rope), dim=-1)
    for s in range(3):
        k = keys[tables[s]].flatten(0, 1)[: lens[s], 0]  # [L, 576]
        want = F.scaled_dot_product_attention(q[s][:, None], k[None], k[None, :, :512])[:, 0]
        torch.testing.assert_close(got[s], want, atol=2e-6, rtol=1e-5)
    assert kernels.mla_records_supports(q, records)
    assert not kernels.mla_records_supports(q[..., :512], records)
    assert not kernels.mla_records_supports(q, records.float())


@pytest.mark.parametrize("width", [64, 24])  # rows of 128 bytes (vector path) and of 48
def test_copy_views_equals_torch_copy(kernels, width):
    from kvabi.abi.view_copy import CopyPlan

    src = {"s": torch.randn(2, 6, 16, 3, width).bfloat16()}
    dst = {"d": torch.zeros(2, 6, 3, 16, width).bfloat16()}
    pairs = [(dst["d"][p].permute(0, 2, 1, 3), src["s"][p]) for p in range(2)]
    plan = CopyPlan.build(pairs, dst, src)
    assert plan is not None and plan.specs.shape[0] == 2
    plan.run(dst, src, kernels)
    assert all(torch.equal(d, s) for d, s in pairs)
    with pytest.raises(ValueError, match="int64"):
        kernels.copy_views(plan.specs.int())


def test_copy_views_dequantise_every_e4m3_byte_and_int8_row_as_the_codec_does(kernels):
    """fp8 e4m3 bytes (all 256: subnormals, both NaNs) and int8 rows with their scales back to
    bf16, on every ISA build, against kvabi's torch codec (float32 product, then the cast)."""
    from kvabi.abi.view_copy import FROM_E4M3, FROM_INT8_ROWS, CopyPlan, RowOp

    fp8 = torch.arange(256, dtype=torch.uint8).view(4, 64)
    for scale in (1.0, 0.37):
        out = torch.empty(4, 64, dtype=torch.bfloat16)
        plan = CopyPlan.build([(out, fp8)], {"d": out}, {"s": fp8}, [RowOp(FROM_E4M3, scale)])
        plan.run({"d": out}, {"s": fp8}, kernels)
        want = (fp8.view(torch.float8_e4m3fn).float() * scale).bfloat16()
        assert torch.equal(out.isnan(), want.isnan()) and want.isnan().sum() == 2
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), scale
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (5, 19, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(5, 19, 1, generator=gen) * 10 ** torch.randn(5, 19, 1, generator=gen)
    rows = torch.cat((q, scales.view(torch.int8)), dim=-1)  # 64 values, then 4 scale bytes
    out = torch.empty(5, 19, 64, dtype=torch.bfloat16)
    plan = CopyPlan.build([(out, rows)], {"d": out}, {"s": rows}, [RowOp(FROM_INT8_ROWS)])
    plan.run({"d": out}, {"s": rows}, kernels)
    assert torch.equal(out, (q.float() * scales).bfloat16())


def test_copy_views_quantise_rows_as_the_codec_does(kernels):
    """bf16 rows -> fp8 e4m3 (per-tensor scale, saturated), -> int8 with a scale per row and
    -> float32, on every ISA build, bit for bit against the torch codec (kvabi/abi/codec.py)."""
    from kvabi.abi.codec import _encode_per_token_head, _to_fp8
    from kvabi.abi.view_copy import TO_E4M3, TO_F32, TO_INT8_ROWS, CopyPlan, RowOp

    torch.manual_seed(5)
    x = (torch.randn(7, 3, 64) * torch.logspace(-9, 3, 64)).bfloat16()
    x[2, 1].zero_()  # an all-zero row: int8 scale 1
    for scale in (1.0, 0.37):
        fp8 = torch.empty(7, 3, 64, dtype=torch.float8_e4m3fn)
        plan = CopyPlan.build([(fp8, x)], {"d": fp8}, {"s": x}, [RowOp(TO_E4M3, scale)])
        plan.run({"d": fp8}, {"s": x}, kernels)
        want = _to_fp8(x / scale, torch.float8_e4m3fn)
        assert torch.equal(fp8.view(torch.uint8), want.view(torch.uint8)), scale
    # int8: items of 3 rows (one by one), of 37 (16 at a time, then 5), rows of 128 and of 40
    # values (not 16 at a time); all-zero rows inside a batch of 16 too
    for shape in ((7, 3, 64), (3, 37, 64), (2, 40, 128), (2, 19, 40)):
        src = x if shape == x.shape else (torch.randn(shape) * 10 ** torch.randn(shape[:2] + (1,)))
        src = src.bfloat16()
        src[-1, shape[1] // 2].zero_()
        rows = torch.empty(*shape[:2], shape[2] + 4, dtype=torch.int8)
        plan = CopyPlan.build([(rows, src)], {"d": rows}, {"s": src}, [RowOp(TO_INT8_ROWS)])
        plan.run({"d": rows}, {"s": src}, kernels)
        assert torch.equal(rows, _encode_per_token_head(src, "int8")), shape
    wide = torch.empty(7, 3, 64)
    plan = CopyPlan.build([(wide, x)], {"d": wide}, {"s": x}, [RowOp(TO_F32)])
    plan.run({"d": wide}, {"s": x}, kernels)
    assert torch.equal(wide, x.float())
