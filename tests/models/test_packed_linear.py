import pytest
import torch
import torch.nn.functional as F

from kvabi.models.packed_linear import PackedLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_row_count(dtype, bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 40, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    lin = PackedLinear(weight, b)
    for rows in (1, 3, 16, 17, 200):
        x = torch.randn(rows, 40, dtype=dtype)
        with torch.inference_mode():
            got, want = lin(x), F.linear(x, weight, b)
        assert got.shape == (rows, 96) and got.dtype == dtype
        # same products, another summation order: within a few ulps of the output
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


def test_packing_happens_where_the_library_has_it_and_is_optional():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert PackedLinear(weight, pack=False).packed is None
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert PackedLinear(weight).packed is not None
    # an input that needs gradients takes the plain path (the packed ops are inference-only)
    x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    assert PackedLinear(weight)(x).requires_grad


def test_tile_packing_where_the_kernels_have_a_packed_gemm():
    from kvabi.models.packed_linear import GEMM_MAX_ROWS
    from kvabi.native.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or kernels.gemm is None:
        pytest.skip("no packed GEMM here (neither AMX nor AVX512-BF16)")
    torch.manual_seed(1)
    weight, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    lin = PackedLinear(weight, b, kernels=kernels)
    assert lin.tiles is not None and lin.packed is None
    for rows in (1, 16, 33, GEMM_MAX_ROWS[kernels.gemm] + 1):  # the last one goes to F.linear
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            got, want = lin(x), F.linear(x, weight, b)
        torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=0)
    # a weight the packed GEMM cannot take (in % 32 != 0) keeps oneDNN's packing
    assert PackedLinear(torch.randn(96, 40, dtype=torch.bfloat16), kernels=kernels).tiles is None
