"""Build and load the C++ CPU kernels next to this file (`cpu_kernels.cpp`), called via ctypes.

They are compiled on first use with the system C++ compiler for this machine's CPU
(`-O3 -march=native -fopenmp`, about 7 s of CPU) into a cache folder keyed by the source, the
flags and the CPU's feature flags (`$KVABI_KERNEL_CACHE`, default `~/.cache/kvabi/kernels`). No
compiler, a failed build or an unsupported input means the torch path runs instead:
`cpu_kernels()` returns None and `kernel_status()` says why.

What the build uses is what the CPU has: `-march=native` turns on the AMX tiles (Intel Sapphire
Rapids and later), the AVX512-BF16 paths (those and AMD Zen 4), or leaves the generic loops,
which the compiler vectorizes for AVX2 or AVX-512 (`ISA_TARGETS`). `$KVABI_KERNEL_ISA` (or
`cpu_kernels(isa)`) builds for a narrower target than the CPU's own, to run a path another
CPU kind would take: `avx2` (x86-64-v3, as a CPU without AVX-512), `avx512` (x86-64-v4: AVX-512
without BF16, as Intel's Skylake-X to Ice Lake), `avx512-bf16` (no AMX).

OpenMP: torch ships its own `libgomp.so.1` and loads it first; the kernel links against the same
soname, so the dynamic loader gives it torch's runtime and there is one thread pool, not two.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# The ISA a build targets: its -march flags and the CPU flags it needs to run.
ISA_TARGETS = {
    "native": (("-march=native",), ()),
    "avx512-bf16": (("-march=x86-64-v4", "-mavx512bf16"), ("avx512f", "avx512bw", "avx512_bf16")),
    # AVX-512 without BF16 (Intel Skylake-X, Cascade Lake, Ice Lake): no packed GEMM
    "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c")),
}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_status: list[str] = ["not built yet"]


_threads = threading.local()


def kernel_threads() -> int:
    """The threads a kernel call from this thread uses: torch's count, unless `limit_threads`
    set this thread's own."""
    return getattr(_threads, "count", None) or torch.get_num_threads()


@contextlib.contextmanager
def limit_threads(count: int) -> Iterator[None]:
    """Kernel calls from this thread use `count` threads meanwhile (a helper thread beside a
    forward that holds torch's threads: vLLM forbids `torch.set_num_threads` once bound)."""
    before = getattr(_threads, "count", None)
    _threads.count = count
    try:
        yield
    finally:
        _threads.count = before


def kernel_status() -> str:
    """Why the kernel is or is not in use ("loaded from ..." or the build failure)."""
    return _status[0]


def has_native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX-512 BF16 or AMX): elsewhere torch
    widens bf16 GEMMs to fp32 in software, measured 4x slower than fp32 at 512 rows on a
    2-core AVX2-only EPYC."""
    flags = _cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or "?"."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    return next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def isa_gap(isa: str) -> str | None:
    """Why kernels built for `isa` cannot run on this CPU (an unknown target, a missing CPU
    flag), or None."""
    if isa not in ISA_TARGETS:
        return f"unknown ISA target {isa!r} (one of {', '.join(ISA_TARGETS)})"
    missing = [f for f in ISA_TARGETS[isa][1] if f not in _cpu_flags().split()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _build(isa: str = "native") -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++/c++) on PATH")
    flags = (*ISA_TARGETS[isa][0], *FLAGS)
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((compiler, *flags)).encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVABI_KERNEL_CACHE", Path.home() / ".cache/kvabi/kernels"))
    target = root / key / "cpu_kernels.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, *flags, str(SOURCE), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders never see half a file
    return target


class EntrySpans(ctypes.Structure):
    """Mirrors `EntrySpans` in cpu_kernels.cpp: where a tier entry's checksums lie (the meta
    bytes, each section's header bytes and payload); `of` builds one from offsets."""

    _fields_ = [("meta_len", ctypes.c_int64), ("sections", ctypes.c_int64),
                ("head_len", ctypes.c_int64), ("heads", ctypes.c_void_p),
                ("payloads", ctypes.c_void_p), ("payload_lens", ctypes.c_void_p)]  # fmt: skip

    @classmethod
    def of(cls, meta_len: int, table: np.ndarray, head_len: int) -> EntrySpans:
        """`table`: int64 `[sections, 3]` of header offset, payload offset, payload length
        (kept alive by the struct: it points into its columns)."""
        columns = np.ascontiguousarray(np.asarray(table, dtype=np.int64).reshape(-1, 3).T)
        spans = cls(meta_len, columns.shape[1], head_len, *(c.ctypes.data for c in columns))
        spans._columns = columns  # the memory the pointers name
        return spans


class DecodeLayer(ctypes.Structure):
    """Mirrors `DecodeLayer` in cpu_kernels.cpp: one layer's weights and KV pools (pointers)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias",
            "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
        )
    ]  # fmt: skip


class DecodeShape(ctypes.Structure):
    """Mirrors `DecodeShape` in cpu_kernels.cpp (pool strides in elements)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "block_stride", "slot_stride", "head_stride", "block_size",
        )
    ] + [("eps", ctypes.c_float)]  # fmt: skip


GEMMS = {2: "AMX tiles", 1: "AVX512-BF16 dot products"}  # by kvabi_gemm_init's code
DECODE_VARIANTS = ("generic loop, head_dim read at run time", "generic loop, head_dim unrolled",
                   "AVX512-BF16 instance")  # by kvabi_paged_decode_variant's code  # fmt: skip


def _unsupported(*tensors: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors (dtype, device), or None."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return f"dtype {str(dtype).removeprefix('torch.')} (the kernels take float32, bfloat16)"
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return "tensors not all on the CPU in one dtype"
    return None


class CpuKernels:
    """The compiled kernels. Each method checks what it can take (`*_supports`); callers keep
    the torch path for anything else. float32 and bfloat16 only."""

    def __init__(self, lib: ctypes.CDLL, isa: str = "native") -> None:
        self.isa = isa  # the ISA target it was built for (`ISA_TARGETS`)
        i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        signatures = {
            "kvabi_paged_decode": [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr]
            + [i64, c_int, c_int, c_int, c_float, c_int],
            "kvabi_rms_norm": [c_int, ptr, i64, ptr, ptr, ptr, i64, i64, c_float, c_int],
            "kvabi_silu_and_mul": [c_int, ptr, ptr, i64, i64, c_int],
            "kvabi_rope": [c_int, ptr, i64, i64, i64, i64, ptr, ptr, c_int],
            "kvabi_packed_linear": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, c_int],
            "kvabi_decode_layers": [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr]
            + [c_int],
            "kvabi_prefill_attention": [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, c_int, c_int]
            + [c_int, c_float, c_int],
            "kvabi_mla_decode_records": [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64, c_int]
            + [c_float, c_int],
            "kvabi_copy_views": [ptr, i64, c_int],
            "kvabi_transpose_views": [ptr, i64, c_int],
        }
        lib.kvabi_paged_decode_variant.argtypes = [c_int, c_int, c_int]
        lib.kvabi_paged_decode_variant.restype = c_int
        self._variant = lib.kvabi_paged_decode_variant
        lib.kvabi_attend_parts.argtypes = [i64, i64, c_int]
        lib.kvabi_attend_parts.restype = i64
        self._attend_parts = lib.kvabi_attend_parts
        self._fns = {}
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[name] = fn
        self._read_files = getattr(lib, "kvabi_read_files", None)  # POSIX builds only
        if self._read_files is not None:
            self._read_files.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, c_int]
            self._read_files.restype = c_int
        lib.kvabi_transpose_is_vectorized.restype = c_int
        # whether transposing copies run in AVX-512 registers (else element by element)
        self.transposes_fast = bool(lib.kvabi_transpose_is_vectorized())
        lib.kvabi_xxh3_64.argtypes, lib.kvabi_xxh3_64.restype = [ptr, i64], ctypes.c_uint64
        self._xxh3 = lib.kvabi_xxh3_64
        self._entry_sums = lib.kvabi_entry_checksums
        self._entry_sums.argtypes = [ptr, i64, i64, ptr, ptr, c_int]
        self._entry_sums.restype = c_int
        lib.kvabi_gemm_init.argtypes, lib.kvabi_gemm_init.restype = [c_int], c_int
        # The packed bf16 GEMM (`gemm_linear`): AMX tiles where built for this CPU and the tile
        # state is granted to this process, else AVX512-BF16 dot products where the CPU has
        # them, else none (oneDNN's GEMM runs). $KVABI_NO_AMX set: never the AMX tiles.
        code = lib.kvabi_gemm_init(0 if os.environ.get("KVABI_NO_AMX") else 1)
        self.gemm: str | None = GEMMS.get(code)
        self.amx = code == 2  # the AMX tiles (the packed GEMM and the prefill attention use them)

    def _call(self, name: str, *args: object) -> None:
        code = self._fns[name](*args, kernel_threads())
        if code != 0:
            raise RuntimeError(f"{name} failed with code {code}")

    def copy_views(self, specs: torch.Tensor) -> None:
        """Run the strided copies `specs` describes ([count, 21] int64 rows: dst and src
        addresses, outer dims, shape, byte strides of each, row, row op, scale;
        `kvabi/abi/view_copy.py` builds them) in one call."""
        if specs.dtype != torch.int64 or specs.dim() != 2 or not specs.is_contiguous():
            raise ValueError("copy_views: specs must be a contiguous [count, 21] int64 tensor")
        if specs.shape[1] != 21:
            raise ValueError(f"copy_views: rows of {specs.shape[1]} values, not 21")
        self._call("kvabi_copy_views", specs.data_ptr(), specs.shape[0])

    def transpose_views(self, specs: torch.Tensor) -> None:
        """Run the transposing copies `specs` describes ([count, 19] int64 rows:
        `kvabi/abi/view_copy.py` `transpose_spec`) in one call."""
        if specs.dtype != torch.int64 or specs.dim() != 2 or not specs.is_contiguous():
            raise ValueError("transpose_views: specs must be a contiguous [count, 19] int64 tensor")
        if specs.shape[1] != 19:
            raise ValueError(f"transpose_views: rows of {specs.shape[1]} values, not 19")
        self._call("kvabi_transpose_views", specs.data_ptr(), specs.shape[0])

    def xxh3_64(self, data: bytes | bytearray | memoryview | np.ndarray) -> int:
        """XXH3-64 with seed 0 of `data`'s bytes (what `xxhash.xxh3_64_intdigest` gives)."""
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
            raise ValueError("xxh3_64: contiguous bytes")
        return int(self._xxh3(buf.ctypes.data if len(buf) else None, len(buf)))

    def entry_checksums(self, rows: np.ndarray, spans: EntrySpans, num_threads: int) -> np.ndarray:
        """The checksums of the tier entries in `rows` (uint8 `[n, size]`, C order) where
        `spans` says (`EntrySpans.of`): uint64 `[n, sections + 2]`, without the GIL."""
        if rows.dtype != np.uint8 or rows.ndim != 2 or not rows.flags.c_contiguous:
            raise ValueError("entry_checksums: rows must be a C-contiguous 2-D uint8 array")
        out = np.empty((rows.shape[0], spans.sections + 2), dtype=np.uint64)
        if not rows.shape[0]:
            return out
        code = self._entry_sums(rows.ctypes.data, rows.shape[0], rows.shape[1],
                                ctypes.byref(spans), out.ctypes.data, num_threads)  # fmt: skip
        if code != 0:
            raise ValueError(f"entry_checksums: a span lies outside the {rows.shape[1]}-byte rows")
        return out

    @property
    def reads_files(self) -> bool:
        """Whether `read_files` is built here (a POSIX system)."""
        return self._read_files is not None

    def read_files(
        self, paths: Sequence[str], rows: np.ndarray, now_ns: int, num_threads: int,
        spans: EntrySpans | None = None,
    ) -> tuple[list[int], np.ndarray | None]:  # fmt: skip
        """Read file i of `paths` into row i of `rows` (uint8 `[>= len(paths), size]`, C
        order), at most `size` bytes each, with the GIL released; stamp each with `now_ns`.
        Per file: the bytes read, or -errno where it could not be opened or read. With
        `spans`, also each whole file's entry checksums (`entry_checksums`), taken as it is
        read (rows of a file cut short are left unset)."""
        if rows.dtype != np.uint8 or rows.ndim != 2 or not rows.flags.c_contiguous:
            raise ValueError("read_files: rows must be a C-contiguous 2-D uint8 array")
        if len(paths) > len(rows):
            raise ValueError(f"read_files: {len(paths)} files for {len(rows)} rows")
        sums = np.empty((len(paths), spans.sections + 2), dtype=np.uint64) if spans else None
        if not paths:
            return [], sums
        names = [os.fsencode(p) for p in paths]
        c_paths = (ctypes.c_char_p * len(names))(*names)
        got = (ctypes.c_int64 * len(names))()
        code = self._read_files(c_paths, len(names), rows.ctypes.data, rows.shape[1], now_ns,
                                got, ctypes.byref(spans) if spans else None,
                                sums.ctypes.data if sums is not None else None,
                                num_threads)  # fmt: skip
        if code != 0:
            raise ValueError(f"kvabi_read_files: a span lies outside the {rows.shape[1]}-byte rows")
        return list(got), sums

    @staticmethod
    def paged_decode_gap(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """Why `paged_decode` cannot take these (q [S, H, D], pool views), or None if it can."""
        if (why := _unsupported(q, k, v)) is not None:
            return why
        if k.stride() != v.stride() or k.stride(-1) != 1:
            return "K and V pools of other strides, or head_dim not contiguous"
        if q.shape[1] % k.shape[2]:
            return f"{q.shape[1]} query heads on {k.shape[2]} KV heads"
        return None

    @staticmethod
    def paged_decode_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return CpuKernels.paged_decode_gap(q, k, v) is None

    def paged_decode_variant(self, dtype: torch.dtype, head_dim: int, group: int) -> str:
        """The loop `paged_decode` runs for this dtype, head size and query heads per KV head
        (the C++ dispatch's own choice): one of `DECODE_VARIANTS`."""
        return DECODE_VARIANTS[self._variant(DTYPE_CODES[dtype], head_dim, group)]

    def attend_parts(self, num_items: int, longest: int) -> int:
        """How many parts the bf16 decode splits each (sequence, KV head)'s keys into, for
        `num_items` of them (sequences x KV heads), the longest context `longest` keys, on this
        thread's kernel threads: 1 where there are a few items per thread; else parts of 64+
        keys, merged after (batch 1 otherwise leaves threads idle)."""
        return int(self._attend_parts(num_items, longest, kernel_threads()))

    def paged_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of one query token per sequence over its paged K/V, read in place.

        q [S, H, D]; k, v: canonical pool views [num_blocks, block_size, H_kv, D] with equal
        strides and a contiguous last axis; tables [S, W] int64 (entries past a sequence's
        context are never read); context_lens [S] int64. Softmax scale 1/sqrt(D). -> [S, H, D]
        """
        q, tables, lens = q.contiguous(), tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        self._call(
            "kvabi_paged_decode",
            DTYPE_CODES[q.dtype],
            q.data_ptr(),
            out.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            *k.stride()[:3],
            k.shape[1],
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            num_seqs,
            num_heads,
            k.shape[2],
            head_dim,
            head_dim**-0.5,
        )
        return out

    @staticmethod
    def mla_records_gap(q: torch.Tensor, records: torch.Tensor) -> str | None:
        """Why `mla_decode_records` cannot take these, or None: q [S, H, 576] (any float
        dtype: the kernel computes in float32); records: a canonical pool view
        [num_blocks, block_size, 1, 656] of u8 with whole records."""
        if not q.device.type == records.device.type == "cpu":
            return "tensors not on the CPU"
        if q.dim() != 3 or q.shape[-1] != 576:
            return f"query of {q.shape[-1]} values (the kernel takes 512 latent + 64 rope)"
        if records.dtype != torch.uint8 or records.dim() != 4 or records.shape[2:] != (1, 656):
            return "pool not of 656-byte fp8_ds_mla records"
        return None if records.stride(-1) == 1 else "records not contiguous"

    @staticmethod
    def mla_records_supports(q: torch.Tensor, records: torch.Tensor) -> bool:
        return CpuKernels.mla_records_gap(q, records) is None

    def mla_decode_records(
        self, q: torch.Tensor, records: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """Absorbed MLA decode over fp8_ds_mla records read in place: q [S, H, 576] ->
        [S, H, 512] float32; scores scaled by 1/sqrt(576) (the model folds its own scale into
        q, as `AttentionFn` says); tables [S, W] int64, lens [S] int64."""
        q = q.float().contiguous()
        tables, lens = tables.contiguous(), lens.contiguous()
        out = q.new_empty((*q.shape[:-1], 512))
        self._call(
            "kvabi_mla_decode_records",
            q.data_ptr(),
            out.data_ptr(),
            records.data_ptr(),
            records.stride(0),
            records.stride(1),
            records.shape[1],
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            q.shape[0],
            q.shape[1],
            576**-0.5,
        )
        return out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HF's RMSNorm of x [rows, n] -> [rows, n]. With `residual` (contiguous, same shape),
        first `residual += x` in place, then normalise the sum (the fused residual add)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=x.dtype)
        res = 0 if residual is None else residual.data_ptr()
        args = (x.data_ptr(), x.stride(0), res, weight.contiguous().data_ptr(), out.data_ptr())
        self._call("kvabi_rms_norm", DTYPE_CODES[x.dtype], *args, rows, n, eps)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 2n] = gate | up -> silu(gate) * up [rows, n]."""
        x = x.contiguous()
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, n, dtype=x.dtype)
        self._call(
            "kvabi_silu_and_mul", DTYPE_CODES[x.dtype], x.data_ptr(), out.data_ptr(), rows, n
        )
        return out

    @staticmethod
    def gemm_supports(weight: torch.Tensor) -> bool:
        """Whether `gemm_pack` takes this [out, in] weight (bf16, out % 16 == 0, in % 32 == 0)."""
        out_features, in_features = weight.shape
        return weight.dtype == torch.bfloat16 and out_features % 16 == 0 and in_features % 32 == 0

    @staticmethod
    def gemm_pack(weight: torch.Tensor) -> torch.Tensor:
        """weight [n, k] -> the AMX B-tile order `gemm_linear` streams (both of its GEMMs):
        [n/16, k/32, 16, 16, 2], element [j, s, p, c, e] = weight[16 j + c, 32 s + 2 p + e]
        (a new contiguous copy)."""
        n, k = weight.shape
        tiles = weight.detach().reshape(n // 16, 16, k // 32, 16, 2)
        return tiles.permute(0, 2, 3, 1, 4).contiguous()

    def gemm_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, k] bf16 (unit column stride) @ weight.T (+ bias) -> [rows, n] bf16, with
        `packed = gemm_pack(weight)`. Only where `self.gemm`."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        n = packed.shape[0] * 16
        if k != packed.shape[1] * 32 or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"gemm_linear: x [{rows}, {k}] or bias does not fit W [{n}, ...]")
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        b = 0 if bias is None else bias.data_ptr()
        args = (x.data_ptr(), x.stride(0), packed.data_ptr(), b, y.data_ptr(), n, rows, n, k)
        self._call("kvabi_packed_linear", *args)
        return y

    def decode_layers(
        self,
        layers: ctypes.Array,
        shape: DecodeShape,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> None:
        """Run all `layers` (a `DecodeLayer` array) of a decode step in one call, bf16 with the
        packed GEMM: x [rows, hidden] contiguous is the residual stream, updated in place; each
        row is one sequence's new token, with cos/sin [rows, head_dim], its slot (slot_blocks,
        slot_offsets [rows] int64) and its block table and context length (tables [rows, W],
        context_lens [rows] int64; the context includes the new token)."""
        cos, sin = cos.contiguous(), sin.contiguous()
        longs = [t.contiguous() for t in (slot_blocks, slot_offsets, tables, context_lens)]
        if (
            x.dtype != torch.bfloat16
            or not x.is_contiguous()
            or any(t.dtype != torch.int64 for t in longs)
        ):
            raise ValueError("decode_layers: x must be contiguous bf16, the indices int64")
        blocks, offsets, tables, lens = longs
        self._call(
            "kvabi_decode_layers",
            ctypes.addressof(layers),
            len(layers),
            ctypes.addressof(shape),
            x.data_ptr(),
            x.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            blocks.data_ptr(),
            offsets.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
        )

    def prefill_gap(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """Why `prefill_attention` cannot take these, or None (it takes bf16 with AMX or
        AVX512-BF16, head size % 32 == 0, each row's heads and dims contiguous, at least as many
        keys as queries)."""
        if self.gemm is None:
            return "neither AMX nor AVX512-BF16"
        if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in (q, k, v)):
            return "not bf16 on the CPU"
        if not all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)):
            return "heads and dims not contiguous"
        if k.stride(0) % 2:  # K rows are gathered as pairs of bf16
            return "odd K row stride"
        if q.shape[2] % 32 or not k.shape[2] == v.shape[2] == q.shape[2]:
            return f"head_dim {q.shape[2]} not a multiple of 32"
        if q.shape[1] % k.shape[1]:
            return f"{q.shape[1]} query heads on {k.shape[1]} KV heads"
        if not 0 < q.shape[0] <= k.shape[0] == v.shape[0]:
            return "fewer keys than queries"
        return None

    def prefill_supports(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return self.prefill_gap(q, k, v) is None

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk of tq queries q [tq, H, D] over tk >= tq keys k, v
        [tk, H_kv, D], the queries being the last tq positions; scale 1/sqrt(D) -> [tq, H, D].
        On AMX tiles or AVX512-BF16 dot products (`self.gemm`), with torch's bf16
        flash-attention roundings (see cpu_kernels.cpp)."""
        tq, heads, dim = q.shape
        out = torch.empty(tq, heads, dim, dtype=q.dtype)
        self._call(
            "kvabi_prefill_attention",
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            tq,
            k.shape[0],
            heads,
            k.shape[1],
            dim,
            dim**-0.5,
        )
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [tokens, heads, head_dim] in place (HF rotate_half pairing); heads and
        head_dim must be contiguous (any token stride); cos/sin [tokens, head_dim]."""
        tokens, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"rope_: heads and head_dim must be contiguous, strides {x.stride()}")
        cos, sin = cos.contiguous(), sin.contiguous()
        args = (x.data_ptr(), x.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr())
        self._call("kvabi_rope", DTYPE_CODES[x.dtype], *args)


def cpu_kernels(isa: str | None = None) -> CpuKernels | None:
    """The compiled kernels, or None where they cannot be built here (see `kernel_status`).
    `isa`: the target (`ISA_TARGETS`; default `$KVABI_KERNEL_ISA`, else the CPU's own). Each
    target is built and loaded once per process (`_load`)."""
    if os.environ.get("KVABI_NO_KERNELS"):
        _status[0] = "disabled by KVABI_NO_KERNELS"
        return None
    isa = isa or os.environ.get("KVABI_KERNEL_ISA") or "native"
    return _load(isa)


@functools.cache
def _load(isa: str) -> CpuKernels | None:
    """The kernels built for `isa`, loaded once: every caller shares the one object."""
    if (why := isa_gap(isa)) is not None:
        _status[0] = f"unavailable: kernels for {isa}: {why}"
        return None
    try:
        path = _build(isa)
        kernels = CpuKernels(ctypes.CDLL(str(path)), isa)
    except (OSError, subprocess.SubprocessError) as err:
        _status[0] = f"unavailable: {err}"
        return None
    _status[0] = f"loaded from {path} (built for {isa})"
    return kernels
