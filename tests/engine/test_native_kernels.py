import pytest
import torch
import torch.nn.functional as F

from kvabi.engine.native_kernels import kernel_status, paged_decode_kernel


def test_the_kernel_builds_on_this_machine():
    # The suite runs where a C++ compiler exists (llama-cpp-python is built from source too);
    # a build failure here is a defect, not a reason to fall back silently.
    assert paged_decode_kernel() is not None, kernel_status()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(9, 3, 16), (4, 4, 1), (8, 2, 5)])
def test_kernel_equals_the_torch_path(dtype, layout, heads, kv_heads, block_size):
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.fail(kernel_status())
    gen = torch.Generator().manual_seed(heads * block_size)
    num_blocks, dim = 40, 32
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
    got = kernel(q, k, v, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    want = torch_decode(q, k, v, tables, lens)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:  # one rounding of the float32 result to bf16
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-2, rtol=1e-2)


def test_kernel_never_reads_past_the_context():
    # Table entries past a sequence's context point at a block full of NaN: a read would show.
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.fail(kernel_status())
    k = torch.randn(4, 4, 1, 8)
    v = torch.randn(4, 4, 1, 8)
    k[3], v[3] = float("nan"), float("nan")
    k[0, 2:], v[0, 2:] = float("nan"), float("nan")  # slots after the context in its last block
    tables = torch.tensor([[1, 0, 3]])
    out = kernel(torch.randn(1, 2, 8), k, v, tables, torch.tensor([6]))
    assert torch.isfinite(out).all()
