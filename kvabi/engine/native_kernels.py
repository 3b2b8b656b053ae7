"""Build and load the C++ CPU kernels next to this file (`paged_decode.cpp`), called via ctypes.

The kernel is compiled on first use with the system C++ compiler for this machine's CPU
(`-O3 -march=native -fopenmp`, about 2 s) into a cache folder keyed by the source, the flags and
the CPU's feature flags (`$KVABI_KERNEL_CACHE`, default `~/.cache/kvabi/kernels`). No compiler, a
failed build or an unsupported input means the torch path runs instead: `paged_decode_kernel()`
returns None and `kernel_status()` says why.

OpenMP: torch ships its own `libgomp.so.1` and loads it first; the kernel links against the same
soname, so the dynamic loader gives it torch's runtime and there is one thread pool, not two.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_status: list[str] = ["not built yet"]


def kernel_status() -> str:
    """Why the kernel is or is not in use ("loaded from ..." or the build failure)."""
    return _status[0]


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++/c++) on PATH")
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVABI_KERNEL_CACHE", Path.home() / ".cache/kvabi/kernels"))
    target = root / key / "paged_decode.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders never see half a file
    return target


class PagedDecodeKernel:
    """`kernel(q, k, v, tables, context_lens) -> out`, one query token per sequence.

    q [S, H, D]; k, v: canonical pool views [num_blocks, block_size, H_kv, D] with equal strides
    and a contiguous last axis; tables [S, W] int64 (padding is never read past context_lens);
    context_lens [S] int64. Softmax scale 1/sqrt(D).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.kvabi_paged_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64]
        fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return (
            q.dtype in DTYPE_CODES
            and k.dtype == v.dtype == q.dtype
            and k.stride() == v.stride()
            and k.stride(-1) == 1
            and q.shape[1] % k.shape[2] == 0
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        q, tables, lens = q.contiguous(), tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        code = self._fn(
            DTYPE_CODES[q.dtype],
            q.data_ptr(),
            out.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            k.shape[1],
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            num_seqs,
            num_heads,
            k.shape[2],
            head_dim,
            head_dim**-0.5,
            torch.get_num_threads(),
        )
        if code != 0:
            raise RuntimeError(f"paged decode kernel failed with code {code}")
        return out


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None where it cannot be built here (see `kernel_status`)."""
    if os.environ.get("KVABI_NO_KERNELS"):
        _status[0] = "disabled by KVABI_NO_KERNELS"
        return None
    try:
        path = _build()
        kernel = PagedDecodeKernel(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as err:
        _status[0] = f"unavailable: {err}"
        return None
    _status[0] = f"loaded from {path}"
    return kernel
