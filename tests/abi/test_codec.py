"""Quantising codecs keep their stated error bounds (docs/ABI.md section 3); lossless ones are
bit-exact."""

import pytest
import torch

from kvabi.abi.codec import decode, encode, is_lossless_pair
from kvabi.abi.descriptor import Layout, Plane

K = (Plane("k", 4, 64),)
G = torch.Generator().manual_seed(0)
X = torch.randn(50, 4, 64, generator=G) * torch.logspace(-2, 2, 50).reshape(50, 1, 1)


def _round_trip(layout: Layout, planes=K, x=X):
    stored = encode(x, layout, 0, planes)
    return stored, decode(stored, layout, 0, planes)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_float_dtypes_are_exact_for_their_own_values(dtype):
    layout = Layout("KBNHC", 16, dtype)
    first, _ = _round_trip(layout)
    again, _ = _round_trip(layout, x=first.float())
    assert torch.equal(first, again)


@pytest.mark.parametrize("fmt, rel", [("fp8_e4m3", 2**-4), ("fp8_e5m2", 2**-3)])
def test_fp8_per_tensor_bound(fmt, rel):
    layout = Layout("KBNHC", 16, fmt, quant="per_tensor", scales=(0.25, 0.5))
    stored, y = _round_trip(layout, x=X.clamp(-100, 100))
    assert stored.dtype.itemsize == 1
    # relative half-ulp in the normal range; absolute floor from the smallest subnormal step
    floor = 0.25 * torch.finfo(stored.dtype).smallest_normal * 2**-3
    assert ((y - X.clamp(-100, 100)).abs() <= rel * X.abs() + floor).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_per_token_head_bound(fmt):
    stored, y = _round_trip(Layout("KBNHC", 16, fmt, quant="per_token_head"))
    assert stored.shape[-1] == 64 + 4
    amax = X.abs().amax(dim=-1, keepdim=True)
    bound = amax / 254 if fmt == "int8" else X.abs() * 2**-4 + amax / 448 * 2**-9
    assert ((y - X).abs() <= bound * (1 + 1e-6)).all()


def test_q8_0_bound():
    stored, y = _round_trip(Layout("THC", 0, "u8", quant="q8_0", planes="separate"))
    assert stored.shape[-1] == 2 * 34
    amax = X.unflatten(-1, (2, 32)).abs().amax(dim=-1, keepdim=True)
    err = (y - X).unflatten(-1, (2, 32)).abs()
    # half a step, plus 127 steps of the f16 rounding of the step d = amax / 127
    assert (err <= amax / 254 + amax * 2**-11).all()


def test_ds_mla_record_bound_and_size():
    planes = (Plane("latent", 1, 512), Plane("rope", 1, 64))
    x = torch.randn(10, 1, 576, generator=G)
    layout = Layout("BNHC", 64, "u8", quant="fp8_ds_mla", planes="concat")
    stored, y = _round_trip(layout, planes, x)
    assert stored.shape[-1] == 656
    lat, lat_y = x[..., :512], y[..., :512]
    tile_amax = lat.unflatten(-1, (4, 128)).abs().amax(-1, keepdim=True)
    bound = lat.abs().unflatten(-1, (4, 128)) * 2**-4 + tile_amax / 448 * 2**-9
    assert ((lat_y - lat).abs().unflatten(-1, (4, 128)) <= bound * (1 + 1e-6)).all()
    assert torch.equal(y[..., 512:], x[..., 512:].bfloat16().float())


def test_lossless_pairs():
    f32, bf16, f16 = (Layout("KBNHC", 16, d) for d in ("f32", "bf16", "f16"))
    assert is_lossless_pair(bf16, f32) and is_lossless_pair(f16, f32)
    assert not is_lossless_pair(f32, bf16) and not is_lossless_pair(bf16, f16)
