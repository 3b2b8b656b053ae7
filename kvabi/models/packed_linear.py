"""`PackedLinear`: `F.linear` with the weight reordered once into a CPU GEMM's own layout.

PyTorch's `F.linear` hands the plain row-major weight to oneDNN (bf16) or MKL (fp32) on every
call, which reorders it into blocked tiles each time; at serving batch sizes (1-64 rows) that
reorder costs as much as the product. Packing once at load time, as inductor's freezing pass does,
removes it. Two packings:

- bf16 with kvabi's C++ kernels on a CPU with AMX or AVX512-BF16 (`CpuKernels.gemm`): the weight
  is stored in AMX tile order and the GEMM is kvabi's own (`gemm_linear`; `amx_linear` and
  `dot_linear` in cpu_kernels.cpp). At decode sizes it only streams weights: with AMX about 2x
  oneDNN's packed GEMM on SmolLM2's layers at 16 rows (measured over all 30 layers' distinct
  weights, so from memory, not cache), its results equal oneDNN's bit for bit up to 32 rows;
  the AVX512-BF16 one sums in another order (a rare element one bf16 ulp off) and was 1.7x
  oneDNN at 1 row, 1.2x at 16 and 1.05-1.1x from 64 to 1,024 rows on a Zen 4 EPYC. Above
  `GEMM_MAX_ROWS` rows (prefill chunks), where oneDNN's blocking wins, the plain weight goes
  to `F.linear`.

- otherwise oneDNN's (bf16) or MKL's (fp32) packed weight, through their torch ops.

The packed copy is extra memory (one more copy of each weight); the plain weight stays for
`state_dict()`, the reference path and large row counts. Where neither packing applies (another
build of torch, another dtype, odd sizes), `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvabi.native.cpu_kernels import CpuKernels

PACK_ROWS_HINT = 16  # the row count oneDNN/MKL packing is tuned for; any row count works
# the packed GEMM matches or beats oneDNN up to here (per kind; bench in the docstring)
GEMM_MAX_ROWS = {"AMX tiles": 256, "AVX512-BF16 dot products": 1024}


def _can_pack(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    if dtype == torch.float32:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return False


class PackedLinear:
    """y = x @ weight.T + bias, weight [out, in], x [rows, in] -> [rows, out].

    `kernels`: kvabi's CPU kernels; where they have a packed GEMM (AMX or AVX512-BF16) and take
    the weight, their packing is used instead of oneDNN's."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: bool = True,
        kernels: CpuKernels | None = None,
    ) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed: torch.Tensor | None = None  # oneDNN / MKL layout
        self.tiles: torch.Tensor | None = None  # AMX tile order, for self.kernels' packed GEMM
        self.kernels = kernels
        if not pack or self.weight.device.type != "cpu":
            return
        ours = kernels is not None and kernels.gemm and kernels.gemm_supports(self.weight)
        if ours and (self.bias is None or self.bias.dtype == torch.bfloat16):
            self.tiles = kernels.gemm_pack(self.weight)
            self.max_rows = GEMM_MAX_ROWS[kernels.gemm]
            return

        if _can_pack(self.weight.dtype):
            if self.weight.dtype == torch.bfloat16:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
            else:
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_ROWS_HINT)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        plain = x.dim() != 2 or x.dtype != self.weight.dtype or x.requires_grad
        if self.tiles is not None and self.kernels is not None:
            if plain or x.shape[0] > self.max_rows:
                return F.linear(x, self.weight, self.bias)
            return self.kernels.gemm_linear(x, self.tiles, self.bias)
        if self.packed is None or plain:
            return F.linear(x, self.weight, self.bias)
        if self.weight.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, PACK_ROWS_HINT)
