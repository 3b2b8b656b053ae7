"""vLLM's DeepSeek V3.2 indexer key cache: fp8 e4m3 keys with one float32 scale per token.

One token of an indexer plane of width D (DeepSeek V3.2: index_head_dim 128) is D fp8 e4m3fn
codes and one little-endian float32 scale, D + 4 bytes (132). A block of N tokens is stored as
vLLM's `DeepseekV32IndexerCache` holds it (`model_executor/models/deepseek_v2.py`; written by
`indexer_k_quant_and_cache_kernel`, read by `cp_gather_indexer_k_quant_cache_kernel`, both in
`csrc/cache_kernels.cu`): the N tokens' codes first, token-major, then their N scales,

    [0, N D)            codes, token t's at [t D, (t + 1) D)
    [N D, N (D + 4))    float32 scales, token t's at N D + 4 t

so an unpaged cache (N = 1) is one record per token: D codes, then the scale.
Reading: key[t, j] = float(code[t, j]) * scale[t].
"""

from __future__ import annotations

import torch

from kvabi.abi.errors import CodecError, ShapeError

SCALE_BYTES = 4
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # vLLM: `fmaxf(amax, 1e-4) / 448`, so an all-zero key has scale 2^-22


def record_bytes(dim: int) -> int:
    """Bytes one token of an indexer plane of width `dim` occupies: codes, then its scale."""
    return dim + SCALE_BYTES


def encode_tokens(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[T, D]` keys -> (u8 codes `[T, D]`, float32 scales `[T]`), as vLLM writes them.

    Follows `indexer_k_quant_and_cache_kernel` (vLLM `csrc/cache_kernels.cu`, scale_fmt "ue8m0",
    quant_block_size = D, DeepSeek V3.2's 128): `amax = max |x|` over the token,
    `scale = fmaxf(amax, 1e-4) / 448` in float32, rounded up to a power of two
    (`exp2f(ceilf(log2f(scale)))`); each code is `x / scale` (exact: a power of two) converted
    to e4m3 with `__NV_SATFINITE` (round to nearest even, saturate at 448). Non-finite keys are
    refused (CodecError): vLLM would store an inf scale and NaN codes.
    """
    if keys.dim() != 2:
        raise ShapeError(f"indexer keys are [num_tokens, dim]; got shape {list(keys.shape)}")
    if not torch.isfinite(keys).all():
        bad = (~torch.isfinite(keys)).nonzero()[0].tolist()
        raise CodecError(f"indexer: non-finite key at index {bad}; refusing to encode it")
    keys = keys.float()
    raw = keys.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / E4M3_MAX  # [T]
    scale = torch.exp2(torch.ceil(torch.log2(raw)))  # [T], ue8m0: a power of two
    q = (keys / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def pack_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-token codes `[T, D]` and scales `[T]` -> blocks `[ceil(T / N), N (D + 4)]` u8.

    Slots after the last token are zero (a reader must not interpret them)."""
    num_tokens, dim = codes.shape
    num_blocks = -(-num_tokens // block_size)
    pad = num_blocks * block_size - num_tokens
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).reshape(num_blocks, -1)
    scale_bytes = torch.nn.functional.pad(scales.float(), (0, pad)).view(torch.uint8)
    return torch.cat([codes, scale_bytes.reshape(num_blocks, -1)], dim=1)


def unpack_blocks(blocks: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `[B, N (D + 4)]` u8 -> (codes `[B N, D]` u8, scales `[B N]` float32)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % record_bytes(dim):
        raise ShapeError(
            f"indexer blocks are uint8 [B, N * {record_bytes(dim)}]; got "
            f"{list(blocks.shape)} {blocks.dtype}"
        )
    block_size = blocks.shape[1] // record_bytes(dim)
    b = blocks.contiguous()
    codes = b[:, : block_size * dim].reshape(-1, dim)
    scales = b[:, block_size * dim :].contiguous().view(torch.float32).reshape(-1)
    return codes, scales


def encode_blocks(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """float `[T, D]` keys -> u8 blocks `[ceil(T / N), N (D + 4)]` in vLLM's byte layout."""
    return pack_blocks(*encode_tokens(keys), block_size)


def decode_blocks(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """u8 blocks `[B, N (D + 4)]` -> float32 keys `[B N, D]`: `float(code) * scale`."""
    codes, scales = unpack_blocks(blocks, dim)
    return codes.view(torch.float8_e4m3fn).float() * scales[:, None]


def token_views(buffer: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views of a buffer's tokens, without copying: codes `[B, N, D]` and scale bytes
    `[B, N, 4]` (an unpaged `[T, D + 4]` buffer is T blocks of one token)."""
    block_size = buffer.shape[1] // record_bytes(dim)
    codes = buffer[:, : block_size * dim].unflatten(1, (block_size, dim))
    scales = buffer[:, block_size * dim :].unflatten(1, (block_size, SCALE_BYTES))
    return codes, scales
