"""vLLM's `fp8_ds_mla` record: one DeepSeek MLA token (kv_lora_rank 512, rope 64) in 656 bytes.

Byte layout (vLLM `v1/attention/backends/mla/flashmla_sparse.py`, module docstring; written by
`concat_and_cache_ds_mla_kernel` in `csrc/cache_kernels.cu`):

    [0, 512)    512 fp8 e4m3fn latent values, q[j]
    [512, 528)  4 float32 tile scales, little-endian, scale[i] for q[128 i : 128 (i + 1)]
    [528, 656)  64 bfloat16 rope values, little-endian, copied unquantised

Reading: latent[j] = q[j] * scale[j // 128] in float32; rope as bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvabi.abi.errors import CodecError, ShapeError

LATENT, TILE, ROPE = 512, 128, 64
NUM_TILES = LATENT // TILE
RECORD_BYTES = LATENT + 4 * NUM_TILES + 2 * ROPE  # 656
E4M3_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal float32


class LatentRope(NamedTuple):
    """The dequantised contents of records `[..., 656]`."""

    latent: torch.Tensor  # [..., 512] float32
    rope: torch.Tensor  # [..., 64] float32 (bf16 values)


def encode_records(values: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 576]` (latent then rope) -> u8 records `[..., 656]`, as vLLM writes them.

    Follows `concat_and_cache_ds_mla_kernel` (vLLM `csrc/cache_kernels.cu`) step by step:
    - per 128-element tile, `amax = max |x|` and `scale = fmaxf(amax / 448.f, FLT_MIN)` in float32;
      an all-zero tile keeps the raw scale FLT_MIN (not 1.0), and its bytes are zeros;
    - each element is `x / scale` (a true float32 division, as `scaled_vec_conversion` in
      `csrc/quantization/.../nvidia/quant_utils.cuh`, not a multiply by the reciprocal),
      converted with `__nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)`: round to nearest
      even, magnitudes past 448 saturate to 448. torch's cast gives NaN past 464, so we clamp
      to +-448 first, which is the same for every finite input;
    - the rope is copied as the model's bf16 values; the scales are the raw float32 bytes.
    vLLM's kernel reads bf16 activations; for bf16-representable input (every bf16 cache and
    model) these bytes are vLLM's. Wider float32 input is quantised directly, not via bf16.

    Non-finite input is refused (CodecError): vLLM would write a tile scale of inf and NaN
    bytes for an inf, and drop NaNs from the amax (fmaxf), a record no reader can trust.
    """
    _check_last_dim(values, LATENT + ROPE, "fp8_ds_mla values")
    if not torch.isfinite(values).all():
        bad = (~torch.isfinite(values)).nonzero()[0].tolist()
        raise CodecError(f"fp8_ds_mla: non-finite value at index {bad}; refusing to encode it")
    values = values.float()
    tiles = values[..., :LATENT].unflatten(-1, (NUM_TILES, TILE))  # [..., 4, 128]
    scale = (tiles.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(FLT_MIN)  # [..., 4, 1]
    q = (tiles / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    parts = [
        q.view(torch.uint8),  # [..., 512]
        scale.squeeze(-1).contiguous().view(torch.uint8),  # [..., 16]
        values[..., LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8),  # [..., 128]
    ]
    return torch.cat(parts, dim=-1)


def ds_mla_records_to_latent_rope(records: torch.Tensor) -> LatentRope:
    """u8 records `[..., 656]` -> the dequantised latent and rope, the read absorbed MLA decode
    does (vLLM's `cp_gather_and_upconvert_fp8_kv_cache` computes `float(q) * scale` and rounds
    it to bf16; this returns the float32 product before that rounding)."""
    _check_last_dim(records, RECORD_BYTES, "fp8_ds_mla records")
    if records.dtype != torch.uint8:
        raise ShapeError(f"fp8_ds_mla records are uint8 bytes, got {records.dtype}")
    b = records.contiguous()
    q = b[..., :LATENT].view(torch.float8_e4m3fn).float()  # [..., 512]
    scale = b[..., LATENT : LATENT + 4 * NUM_TILES].contiguous().view(torch.float32)  # [..., 4]
    latent = q * scale.repeat_interleave(TILE, dim=-1)
    rope = b[..., LATENT + 4 * NUM_TILES :].contiguous().view(torch.bfloat16).float()
    return LatentRope(latent, rope)


def decode_records(records: torch.Tensor) -> torch.Tensor:
    """u8 records `[..., 656]` -> float32 `[..., 576]`: latent then rope."""
    return torch.cat(ds_mla_records_to_latent_rope(records), dim=-1)


def _check_last_dim(t: torch.Tensor, want: int, what: str) -> None:
    if t.dim() == 0 or t.shape[-1] != want:
        got = t.shape[-1] if t.dim() else "a scalar"
        raise ShapeError(f"{what} are {want} wide; got a last dimension of {got}")
