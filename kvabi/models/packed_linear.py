"""`PackedLinear`: `F.linear` with the weight reordered once into the CPU GEMM library's layout.

PyTorch's `F.linear` hands the plain row-major weight to oneDNN (bf16) or MKL (fp32) on every
call, which reorders it into blocked tiles each time; at serving batch sizes (1-64 rows) that
reorder costs as much as the product. Packing once at load time, as inductor's freezing pass does,
removes it: on this CPU (AMX) the per-layer GEMMs of SmolLM2 at 16 rows took ~0.6 of the time
(`kvabi bench throughput` shows the effect end to end). The packed copy is extra memory (one more
copy of each packed weight); the plain weight stays for `state_dict()` and the reference path.

Where the ops are missing (another build of torch) or the dtype is not packed, `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 16  # the row count the packing is tuned for; any row count works


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
    """y = x @ weight.T + bias, weight [out, in], x [rows, in] -> [rows, out]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True
    ) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.packed: torch.Tensor | None = None
        if pack and self.weight.device.type == "cpu" and _can_pack(self.weight.dtype):
            if self.weight.dtype == torch.bfloat16:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
            else:
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_ROWS_HINT)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2 or x.dtype != self.weight.dtype or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        if self.weight.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, PACK_ROWS_HINT)
