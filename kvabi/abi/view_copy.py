"""`CopyPlan`: a whole-cache conversion between layouts that store the same values (a permute,
layer-first to block-first) as one C++ call over byte offsets worked out once.

Such a conversion is a strided view-to-view copy per layer and plane. Done view by view, on 2
cores for SmolLM2's 64 blocks (23.6 MB, 60 planes), building the views cost 0.74 ms and torch's
60 `copy_` calls 2.0 ms (0.79 of a plain copy of the bytes) against 1.6 ms for the plain copy:
0.52 in all. A plan records each copy once per (source layout, destination layout, buffer
shapes and strides) as offsets into the buffers, so a conversion between buffers of that
geometry adds the buffers' addresses to the offsets and hands every copy to
`kvabi_copy_views` (kvabi/native/cpu_kernels.cpp) in one parallel region, a contiguous row
at a time. A row may also be quantised on the way (`RowOp`: bf16 to fp8 e4m3 with a per-tensor
scale, or to int8 with a scale per row), exactly as kvabi's torch codec does it. Copies it
cannot take (differing dtypes or shapes, an innermost dim not contiguous in both, more dims
than a spec holds) make `CopyPlan.build` return None: the caller converts view by view as
before. No kernels, no plan.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

COPY_DIMS = 5  # outer dims a spec holds (kCopyDims in cpu_kernels.cpp)
# one spec: dst, src, nd, shape[COPY_DIMS], dst strides, src strides (bytes), row, op, scale
SPEC_WIDTH = 3 + 3 * COPY_DIMS + 3
# how a row moves (RowOp in cpu_kernels.cpp): its bytes; bf16 -> fp8 e4m3 of x / scale,
# saturated; bf16 -> int8 and a float32 scale per row (kvabi's per_token_head codec); bf16 ->
# float32; and back: int8 rows with their scale -> bf16, fp8 e4m3 -> bf16 of e4m3 * scale
COPY, TO_E4M3, TO_INT8_ROWS, TO_F32, FROM_INT8_ROWS, FROM_E4M3 = 0, 1, 2, 3, 4, 5
# each row op's (source dtypes, destination dtypes)
_FP8 = (torch.float8_e4m3fn, torch.uint8)
_OP_DTYPES = {
    TO_E4M3: ((torch.bfloat16,), _FP8),
    TO_INT8_ROWS: ((torch.bfloat16,), (torch.int8,)),
    TO_F32: ((torch.bfloat16,), (torch.float32,)),
    FROM_INT8_ROWS: ((torch.int8,), (torch.bfloat16,)),
    FROM_E4M3: (_FP8, (torch.bfloat16,)),
}


@dataclass(frozen=True)
class RowOp:
    """What a copy does to each innermost row (`COPY`, `TO_E4M3` with `scale`, `TO_INT8_ROWS`,
    `TO_F32`, and back: `FROM_INT8_ROWS`, `FROM_E4M3` with `scale`)."""

    op: int = COPY
    scale: float = 1.0


@dataclass(frozen=True)
class CopyPlan:
    """Copies as specs whose first two columns are byte offsets into the buffers
    `dst_names[dst_index[i]]` and `src_names[src_index[i]]` (the i-th copy), to which `run`
    adds the buffers' addresses."""

    specs: torch.Tensor  # [count, SPEC_WIDTH] int64, addresses as offsets
    dst_index: torch.Tensor  # [count] int64: which of `dst_names` each copy writes
    src_index: torch.Tensor
    dst_names: tuple[str, ...]
    src_names: tuple[str, ...]

    @classmethod
    def build(
        cls,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        dst_buffers: Mapping[str, torch.Tensor],
        src_buffers: Mapping[str, torch.Tensor],
        ops: Sequence[RowOp] | None = None,
    ) -> CopyPlan | None:
        """The plan for `dst.copy_(src)` over `pairs` of views into these buffers (or, with
        `ops`, each pair's row op), or None where a pair is not one the kernel takes."""
        dst_names, src_names = tuple(dst_buffers), tuple(src_buffers)
        rows, dst_index, src_index = [], [], []
        for i, (dst, src) in enumerate(pairs):
            spec = _spec(dst, src, ops[i] if ops is not None else RowOp())
            if spec is None:
                return None
            if not spec:
                continue
            d, d_off = _locate(dst, dst_buffers)
            s, s_off = _locate(src, src_buffers)
            if d is None or s is None:
                return None
            spec[0], spec[1] = d_off, s_off
            rows.append(spec)
            dst_index.append(dst_names.index(d))
            src_index.append(src_names.index(s))
        return cls(
            torch.tensor(rows, dtype=torch.int64).reshape(-1, SPEC_WIDTH),
            torch.tensor(dst_index, dtype=torch.int64),
            torch.tensor(src_index, dtype=torch.int64),
            dst_names,
            src_names,
        )

    def run(
        self,
        dst_buffers: Mapping[str, torch.Tensor],
        src_buffers: Mapping[str, torch.Tensor],
        kernels: object,
    ) -> None:
        """Run the copies between these buffers (the plan's geometry: the caller keys plans by
        it). `kernels`: `CpuKernels`."""
        if not len(self.specs):
            return
        specs = self.specs.clone()
        dst = torch.tensor([dst_buffers[n].data_ptr() for n in self.dst_names], dtype=torch.int64)
        src = torch.tensor([src_buffers[n].data_ptr() for n in self.src_names], dtype=torch.int64)
        specs[:, 0] += dst[self.dst_index]
        specs[:, 1] += src[self.src_index]
        kernels.copy_views(specs)  # type: ignore[attr-defined]


def geometry(buffers: Mapping[str, torch.Tensor]) -> tuple:
    """What a plan depends on in a set of buffers: names, shapes, strides, dtypes, devices."""
    return tuple(
        (n, tuple(t.shape), t.stride(), t.dtype, t.device.type) for n, t in buffers.items()
    )


def _locate(view: torch.Tensor, buffers: Mapping[str, torch.Tensor]) -> tuple[str | None, int]:
    """Which buffer `view` looks into, and the byte offset of its first element there."""
    ptr = view.data_ptr()
    for name, t in buffers.items():
        base = t.data_ptr()
        if base <= ptr < base + t.numel() * t.element_size():
            return name, ptr - base
    return None, 0


def _spec(dst: torch.Tensor, src: torch.Tensor, op: RowOp | None = None) -> list[int] | None:
    """The pair as a kernel spec with absolute addresses ([] for no elements), or None if it is
    not one the kernel takes: a plain strided copy (one dtype), or `op`'s conversion of rows
    (the innermost dim; int8 rows 4 bytes longer, for the scale)."""
    op = op or RowOp()
    if dst.dim() == 0 or dst.dim() != src.dim() or dst.shape[:-1] != src.shape[:-1]:
        return None
    if dst.device.type != "cpu" or src.device.type != "cpu":
        return None
    # an int8 row's 4 scale bytes follow its values: on the destination side quantising, on
    # the source side going back
    dst_extra, src_extra = {TO_INT8_ROWS: (4, 0), FROM_INT8_ROWS: (0, 4)}.get(op.op, (0, 0))
    values = src.shape[-1] - src_extra  # a row's values
    if dst.shape[-1] != values + dst_extra or dst.stride(-1) != 1 or src.stride(-1) != 1:
        return None
    if op.op == COPY and dst.dtype != src.dtype:
        return None
    if op.op != COPY and not (
        src.dtype in _OP_DTYPES[op.op][0] and dst.dtype in _OP_DTYPES[op.op][1]
    ):
        return None
    if dst.numel() == 0:
        return []
    outer = list(zip(dst.shape[:-1], dst.stride()[:-1], src.stride()[:-1], strict=True))
    dims = [d for d in outer if d[0] != 1]
    row_n = values
    if op.op not in (TO_INT8_ROWS, FROM_INT8_ROWS):  # merge outer dims into the row where both
        # are contiguous (not an int8 row: its scale covers one token-head, so it stays one)
        while dims and dims[-1][1] == row_n and dims[-1][2] == row_n:
            row_n *= dims.pop()[0]
    merged: list[tuple[int, int, int]] = []
    for n, a, b in reversed(dims):  # merge a dim into the one inside it where both allow
        if merged and a == merged[0][0] * merged[0][1] and b == merged[0][0] * merged[0][2]:
            merged[0] = (n * merged[0][0], merged[0][1], merged[0][2])
        else:
            merged.insert(0, (n, a, b))
    if len(merged) > COPY_DIMS:
        return None
    merged = merged or [(1, 0, 0)]
    pad = COPY_DIMS - len(merged)
    shape = [n for n, _, _ in merged] + [1] * pad
    dst_strides = [a * dst.element_size() for _, a, _ in merged] + [0] * pad
    src_strides = [b * src.element_size() for _, _, b in merged] + [0] * pad
    row = row_n * src.element_size() if op.op == COPY else row_n
    scale_bits = int(torch.tensor(op.scale, dtype=torch.float32).view(torch.int32).item())
    return [dst.data_ptr(), src.data_ptr(), len(merged), *shape, *dst_strides, *src_strides,
            row, op.op, scale_bits & 0xFFFFFFFF]  # fmt: skip


TRANSPOSE_DIMS = 4  # outer dims a transposing spec holds (kTransposeDims in cpu_kernels.cpp)
TRANSPOSE_WIDTH = 3 + 3 * TRANSPOSE_DIMS + 4


def transpose_spec(dst: torch.Tensor, src: torch.Tensor) -> list[int] | None:
    """`dst.copy_(src)` of 2-byte elements where the axis contiguous in `src` is not the one
    contiguous in `dst` (vLLM CPU's K^T against token-major blocks), as a kernel spec with
    absolute addresses: outer dims, then the tile (rows: `dst`'s contiguous axis, columns:
    `src`'s), or None where the pair is not such a copy."""
    if dst.dtype != src.dtype or dst.element_size() != 2 or dst.numel() == 0:
        return None
    if dst.device.type != "cpu" or src.device.type != "cpu":
        return None
    template = transpose_template(tuple(dst.shape), dst.stride(), tuple(src.shape), src.stride())
    return None if template is None else [dst.data_ptr(), src.data_ptr(), *template]


@functools.lru_cache(maxsize=256)
def transpose_template(
    shape: tuple[int, ...], dst_stride: tuple[int, ...], src_shape: tuple[int, ...],
    src_stride: tuple[int, ...],
) -> tuple[int, ...] | None:  # fmt: skip
    """`transpose_spec` past its two addresses, per geometry. Every dim but the tile's is an
    outer dim, in order, even of size 1 (a `ReblockPlan` sets the first per run)."""
    if shape != src_shape:
        return None
    dims = [d for d in range(len(shape)) if shape[d] != 1]  # a size-1 dim's stride says nothing
    cols = next((d for d in dims if src_stride[d] == 1), None)
    rows = next((d for d in dims if dst_stride[d] == 1), None)
    if cols is None or rows is None or cols == rows:
        return None
    outer = [d for d in range(len(shape)) if d not in (rows, cols)]
    if len(outer) > TRANSPOSE_DIMS:
        return None
    pad = TRANSPOSE_DIMS - len(outer)
    return (
        len(outer),
        *([shape[d] for d in outer] + [1] * pad),
        *([2 * dst_stride[d] for d in outer] + [0] * pad),
        *([2 * src_stride[d] for d in outer] + [0] * pad),
        shape[rows], shape[cols], 2 * src_stride[rows], 2 * dst_stride[cols],
    )  # fmt: skip
