"""The byte grammar of llama.cpp's KV state (llama.cpp 0c1e57098, src/llama-kv-cache.cpp).

Forms (`LlamaState.form`), all little-endian:
- `seq-v3`: `llama_state_seq_get_data` -- u32 io_magic 0xaf143cd8, i32 seq_id, Memory.
- `seq-v2`: the older seq buffer -- Memory alone.
- `full`: `llama_state_get_data` (v10) -- u32 len, arch name (no NUL), Memory.

Memory (one attention KVCache): u32 n_stream, then per stream u32 cell_count and, if cells,
cell_count x (i32 pos, u32 n_seq_id, [i32 x, y, tok if the model has M-RoPE], i32 seq_id...),
u32 v_trans, u32 n_layer, n_layer x K (i32 type, u64 row_bytes, rows), then n_layer x V: rows
as K when v_trans = 0, else (i32 type, u32 elem_bytes, u32 n_embd_v_gqa, V^T
[n_embd_v_gqa][cell_count] elements). See docs: kv-layouts.md section 3.2.

A sliding-window model (Gemma 3) has llama.cpp's iSWA cache, two KVCaches: the state is the
base cache's Memory (the full-attention layers, ascending), then the SWA cache's Memory (the
sliding layers), each with its own cells (`llama_kv_cache_iswa::state_write`; the bundled
llama.cpp writes, for one seq, the SWA cells its last position still sees: the last n_swa).

This module only parses and writes bytes; llamacpp_model.py maps them to kvabi buffers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvabi.interop.errors import StateFormatError, StateMagicError, StateTruncatedError

IO_MAGIC = 0xAF143CD8
FORMS = ("seq-v3", "seq-v2", "full")
MAX_STREAMS = 4096  # n_stream = n_seq_max at most; anything larger is not a Memory section


@dataclass(frozen=True)
class Cell:
    """One KV cell: its position, the seqs that hold it, and M-RoPE's (x, y, tok) if written."""

    pos: int
    seq_ids: tuple[int, ...]
    ext: tuple[int, int, int] | None = None


@dataclass(frozen=True, eq=False)
class StateTensor:
    """One layer's K or V bytes. `data` (uint8) is `[cells, row_bytes]` for rows, or
    `[n_embd, cells, elem_bytes]` for transposed V."""

    ggml_type: int
    data: np.ndarray
    transposed: bool = False

    @property
    def num_cells(self) -> int:
        return self.data.shape[1 if self.transposed else 0]


@dataclass(frozen=True, eq=False)
class KvStream:
    """One stream's cells (slot order) and, when it has cells, per-layer K and V."""

    cells: tuple[Cell, ...] = ()
    v_trans: bool = False
    k: tuple[StateTensor, ...] = ()
    v: tuple[StateTensor, ...] = ()


@dataclass(frozen=True, eq=False)
class LlamaState:
    """A parsed state buffer: its form, header fields and the KV streams; `swa_streams` are the
    second (SWA) cache's of an iSWA state, () when the state has one cache."""

    streams: tuple[KvStream, ...]
    form: str = "seq-v3"
    seq_id: int = 0  # seq-v3 only: the seq it was read from (ignored on restore)
    arch: str = ""  # full only
    swa_streams: tuple[KvStream, ...] = ()

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise StateFormatError(f"form {self.form!r}; expected one of {FORMS}")


class _Cursor:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(data).cast("B")
        self.at = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise StateTruncatedError(
                f"{what}: needs {n} bytes at offset {self.at}; the buffer "
                f"has {len(self.buf) - self.at} left of {len(self.buf)}"
            )
        self.at += n
        return self.buf[self.at - n : self.at]

    def ints(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def one(self, fmt: str, what: str) -> int:
        return self.ints(fmt, what)[0]

    def array(self, n: int, what: str) -> np.ndarray:
        return np.frombuffer(self.take(n, what), dtype=np.uint8)


def parse_state(
    data: bytes | bytearray | memoryview, form: str = "seq", cell_ext: bool = False
) -> LlamaState:
    """Parse a state buffer. `form`: `seq` (v3 if it starts with io_magic, else v2), one of
    FORMS, or `full`. `cell_ext`: the model writes M-RoPE's extra cell fields (not in the bytes).

    Bytes after the first Memory are an iSWA state's second one (`swa_streams`).
    Raises StateMagicError, StateTruncatedError, or StateFormatError for trailing bytes.
    """
    cur = _Cursor(data)
    first = struct.unpack("<I", cur.buf[:4])[0] if len(cur.buf) >= 4 else None
    if form == "seq":
        form = "seq-v3" if first == IO_MAGIC else "seq-v2"
    seq_id, arch = 0, ""
    if form == "seq-v3":
        if first != IO_MAGIC:
            raise StateMagicError(
                f"seq-v3 state starts with io_magic {IO_MAGIC:#010x}, got "
                f"{'nothing' if first is None else hex(first)}"
            )
        seq_id = cur.ints("Ii", "header")[1]
    elif form == "full":
        arch_bytes = cur.take(cur.one("I", "arch length"), "arch name")
        arch = bytes(arch_bytes).decode("utf-8", errors="replace")
    elif first == IO_MAGIC:
        raise StateMagicError("a seq-v2 state has no io_magic; this buffer is seq-v3")
    streams = _parse_memory(cur, cell_ext)
    swa_streams = _parse_swa_memory(cur, cell_ext) if cur.at != len(cur.buf) else ()
    if cur.at != len(cur.buf):
        raise StateFormatError(
            f"{len(cur.buf) - cur.at} trailing bytes after the state (offset {cur.at})"
        )
    return LlamaState(streams, form, seq_id, arch, swa_streams)


def _parse_swa_memory(cur: _Cursor, cell_ext: bool) -> tuple[KvStream, ...]:
    start = cur.at
    try:
        return _parse_memory(cur, cell_ext)
    except (StateMagicError, StateTruncatedError) as err:
        raise StateFormatError(
            f"{len(cur.buf) - start} trailing bytes after the state (offset {start}) that are "
            f"not a second (SWA) cache: {err}"
        ) from err


def _parse_memory(cur: _Cursor, cell_ext: bool) -> tuple[KvStream, ...]:
    n_stream = cur.one("I", "n_stream")
    if not 0 < n_stream <= MAX_STREAMS:
        raise StateMagicError(
            f"n_stream {n_stream} (offset {cur.at - 4}) is not a KV cache's "
            "stream count: not a llama.cpp KV state, or the wrong form"
        )
    return tuple(_parse_stream(cur, cell_ext) for _ in range(n_stream))


def _parse_stream(cur: _Cursor, cell_ext: bool) -> KvStream:
    cell_count = cur.one("I", "cell_count")
    if cell_count == 0:
        return KvStream()
    cells = tuple(_parse_cell(cur, cell_ext) for _ in range(cell_count))
    v_trans, n_layer = cur.ints("II", "v_trans, n_layer")
    if v_trans > 1:
        raise StateFormatError(f"v_trans is {v_trans}; expected 0 or 1")
    k = tuple(_parse_rows(cur, cell_count, f"K layer {i}") for i in range(n_layer))
    v = tuple(
        _parse_transposed(cur, cell_count, i)
        if v_trans
        else _parse_rows(cur, cell_count, f"V layer {i}")
        for i in range(n_layer)
    )
    return KvStream(cells, bool(v_trans), k, v)


def _parse_cell(cur: _Cursor, cell_ext: bool) -> Cell:
    pos, n_seq_id = cur.ints("iI", "cell")
    ext = cur.ints("iii", "cell ext") if cell_ext else None
    return Cell(pos, cur.ints(f"{n_seq_id}i", "cell seq ids"), ext)


def _parse_rows(cur: _Cursor, cell_count: int, what: str) -> StateTensor:
    ggml_type, row_bytes = cur.ints("iQ", what)
    data = cur.array(cell_count * row_bytes, what).reshape(cell_count, row_bytes)
    return StateTensor(ggml_type, data)


def _parse_transposed(cur: _Cursor, cell_count: int, layer: int) -> StateTensor:
    what = f"V^T layer {layer}"
    ggml_type, elem_bytes, n_embd = cur.ints("iII", what)
    data = cur.array(n_embd * cell_count * elem_bytes, what)
    return StateTensor(ggml_type, data.reshape(n_embd, cell_count, elem_bytes), transposed=True)


def write_state(state: LlamaState) -> bytes:
    """The bytes `parse_state` reads back as `state` (and llama.cpp's set_data accepts)."""
    parts: list[bytes] = []
    if state.form == "seq-v3":
        parts.append(struct.pack("<Ii", IO_MAGIC, state.seq_id))
    elif state.form == "full":
        arch = state.arch.encode()
        parts += [struct.pack("<I", len(arch)), arch]
    for memory in (state.streams, state.swa_streams) if state.swa_streams else (state.streams,):
        parts.append(struct.pack("<I", len(memory)))
        for stream in memory:
            parts += _stream_bytes(stream)
    return b"".join(parts)


def _stream_bytes(stream: KvStream) -> list[bytes]:
    parts = [struct.pack("<I", len(stream.cells))]
    if not stream.cells:
        return parts
    for c in stream.cells:
        parts.append(
            struct.pack(
                f"<iI{'iii' if c.ext else ''}{len(c.seq_ids)}i",
                c.pos,
                len(c.seq_ids),
                *(c.ext or ()),
                *c.seq_ids,
            )
        )
    if len(stream.k) != len(stream.v):
        raise StateFormatError(f"{len(stream.k)} K layers but {len(stream.v)} V layers")
    parts.append(struct.pack("<II", int(stream.v_trans), len(stream.k)))
    planes = [(t, False) for t in stream.k] + [(t, stream.v_trans) for t in stream.v]
    for t, is_vt in planes:
        _check_tensor(t, len(stream.cells), is_vt)
        head = (
            struct.pack("<iII", t.ggml_type, t.data.shape[2], t.data.shape[0])
            if t.transposed
            else struct.pack("<iQ", t.ggml_type, t.data.shape[1])
        )
        parts += [head, np.ascontiguousarray(t.data, dtype=np.uint8).tobytes()]
    return parts


def _check_tensor(t: StateTensor, num_cells: int, is_vt: bool) -> None:
    if t.transposed != is_vt or t.data.ndim != (3 if t.transposed else 2):
        raise StateFormatError(
            f"a {'V^T' if is_vt else 'row'} tensor was expected, got "
            f"{'V^T' if t.transposed else 'rows'} of {t.data.shape}"
        )
    if t.num_cells != num_cells:
        raise StateFormatError(f"tensor holds {t.num_cells} cells; the stream has {num_cells}")
