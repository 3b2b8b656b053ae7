"""Weight dtypes by name; `auto` is bf16 only where the CPU computes bf16 natively."""

from __future__ import annotations

import pytest
import torch

from kvabi.models.checkpoint import parse_dtype
from kvabi.native import cpu_kernels

AVX2 = "flags\t\t: fpu sse sse2 avx avx2 fma"


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (AVX2, torch.float32),
        (AVX2 + " avx512f avx512bw", torch.float32),  # AVX-512 without its BF16 extension
        (AVX2 + " avx512f avx512_bf16", torch.bfloat16),  # AMD Zen 4
        (AVX2 + " avx512f amx_tile amx_bf16", torch.bfloat16),  # Intel with AMX
        ("", torch.float32),  # no /proc/cpuinfo
    ],
)
def test_auto_is_bf16_only_with_native_bf16(
    monkeypatch: pytest.MonkeyPatch, flags: str, want: torch.dtype
) -> None:
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    assert parse_dtype("auto") == want


def test_names_and_torch_dtypes() -> None:
    assert parse_dtype("BF16") == parse_dtype(torch.bfloat16) == torch.bfloat16
    assert parse_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="use auto or one of"):
        parse_dtype("fp16")
