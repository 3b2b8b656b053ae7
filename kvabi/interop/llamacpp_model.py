"""llama.cpp KV state <-> kvabi `CacheBuffers` (the `llamacpp-*` presets), and live contexts.

A state holds no head counts or head dims; they come from the model (`model_spec_from_gguf`).
Reading keys on each cell's `pos` (slot order is not position order), so one seq's cells must
hold positions 0..T-1 exactly once. Writing emits positions 0..T-1 in the target context's
exact format (`LlamaCacheFormat`): llama.cpp refuses any other n_layer, v_trans, type or size.
A sliding-window model's iSWA state (base cache, then SWA cache) maps to full-extent buffers
whose sliding layers hold only their window (sliding.py).
Live `llama_cpp.Llama` contexts: llamacpp_context.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, ModelSpec
from kvabi.abi.kv_groups import window_start
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import (
    InteropError,
    ModelMismatchError,
    StateFormatError,
    UnsupportedTypeError,
)
from kvabi.interop.llamacpp_state import Cell, KvStream, LlamaState, StateTensor, parse_state
from kvabi.interop.llamacpp_state import write_state as _write
from kvabi.interop.sliding import check_windows_held

# ggml type id -> name; each has a `llamacpp-<name>` layout (q4/q5: the q8_0 preset's rows with
# another ggml block codec; bf16-vtrans: the bf16 preset with V^T).
GGML_TYPE_NAMES = {
    0: "f32",
    1: "f16",
    30: "bf16",
    8: "q8_0",
    2: "q4_0",
    3: "q4_1",
    6: "q5_0",
    7: "q5_1",
}


@dataclass(frozen=True)
class LlamaCacheFormat:
    """What a llama.cpp context's KV state must match: K/V ggml types, V transposition, streams."""

    type_k: int = 1
    type_v: int = 1
    v_trans: bool = True
    n_stream: int = 1


def llamacpp_descriptor(model: ModelSpec, fmt: LlamaCacheFormat) -> Descriptor:
    """The kvabi descriptor of a llama.cpp cache in format `fmt` for `model`."""
    if any(x.kind != ATTN for x in model.layers):
        raise UnsupportedTypeError("only attention layers map to llama.cpp's K/V rows")
    if fmt.type_k != fmt.type_v:
        raise UnsupportedTypeError(
            f"K type {_type_name(fmt.type_k)} != V type "
            f"{_type_name(fmt.type_v)}: a kvabi layout has one dtype"
        )
    if fmt.type_k not in GGML_TYPE_NAMES:
        raise UnsupportedTypeError(
            f"ggml type {_type_name(fmt.type_k)} has no kvabi preset; "
            f"supported: {sorted(GGML_TYPE_NAMES.values())}"
        )
    type_name = GGML_TYPE_NAMES[fmt.type_k]
    if fmt.v_trans and type_name not in ("f32", "f16", "bf16"):
        raise UnsupportedTypeError("llama.cpp never transposes a quantised V")
    return preset_descriptor(f"llamacpp-{type_name}" + ("-vtrans" if fmt.v_trans else ""), model)


def state_to_buffers(
    state: LlamaState | bytes, model: ModelSpec, seq_id: int | None = None, form: str = "seq"
) -> CacheBuffers:
    """One seq's KV from a state (parsed, or bytes in `form`) as `llamacpp-*` buffers.

    Cells are put in position order; the base cache's positions must be exactly 0..T-1. A
    model with sliding layers needs an iSWA state: its SWA cells must cover the window of the
    next position T (sliding.py's convention; earlier cells are dropped, their positions
    zero). `seq_id=None` takes the state's only seq. Raises ModelMismatchError when layer
    count, sizes or caches disagree with `model`, UnsupportedTypeError for types without a
    preset, StateFormatError for cells that do not hold the positions needed.
    """
    if not isinstance(state, LlamaState):
        state = parse_state(state, form)
    sections = _sections(state, model, seq_id)
    desc = llamacpp_descriptor(model, _stream_format([x.stream for x in sections]))
    num_tokens = sections[0].num_tokens
    specs = {spec.key: spec for spec in buffer_specs(desc, num_tokens)}
    tensors = {}
    for section in sections:
        _check_geometry(section, specs)
        for j, layer_id in enumerate(section.layer_ids):
            for plane, t in (("k", section.stream.k[j]), ("v", section.stream.v[j])):
                spec = specs[f"{layer_id}.{plane}"]
                tensors[spec.key] = _place(t, spec, section.cell_ids, section.first)
    return CacheBuffers(desc, tensors)


def buffers_to_state(
    cache: CacheBuffers,
    model: ModelSpec,
    fmt: LlamaCacheFormat,
    *,
    num_tokens: int | None = None,
    block_ids: Sequence[int] | None = None,
    seq_id: int = 0,
    form: str = "seq-v3",
    arch: str = "llama",
) -> bytes:
    """State bytes that `llama_state_seq_set_data` (or `llama_state_set_data` for
    form `full`) accepts: the first `num_tokens` tokens of any kvabi cache at positions
    0..T-1 of `seq_id`, converted to the target `model` (llama.cpp's K order) and `fmt`.

    A model with sliding layers gets an iSWA state: the base cache holds the full layers at
    0..T-1, the SWA cache the sliding layers' window of position T (the source must hold it).
    """
    desc = llamacpp_descriptor(model, fmt)
    if num_tokens is None:
        if cache.desc.layout.is_paged:
            raise InteropError(
                "a paged cache does not say how many tokens it holds: give num_tokens"
            )
        num_tokens = cache.extent
    out = convert(cache, desc, num_tokens=num_tokens, src_block_ids=block_ids)
    check_windows_held(out, num_tokens)
    specs = {spec.key: spec for spec in buffer_specs(desc, num_tokens)}
    memories = []
    for layer_ids, first in _cache_layers(model, num_tokens):
        cells = tuple(Cell(pos, (seq_id,)) for pos in range(first, num_tokens))
        planes = [
            _state_tensor(out, specs[f"{i}.{plane}"], fmt, first)
            for plane in ("k", "v")
            for i in layer_ids
        ]
        stream = KvStream(cells, fmt.v_trans, tuple(planes[: len(layer_ids)]),
                          tuple(planes[len(layer_ids) :]))  # fmt: skip
        streams = [KvStream()] * fmt.n_stream
        streams[seq_id if fmt.n_stream > 1 else 0] = stream if cells else KvStream()
        memories.append(tuple(streams))
    swa = memories[1] if len(memories) > 1 else ()
    return _write(LlamaState(memories[0], form, seq_id, arch, swa))


@dataclass(frozen=True, eq=False)
class _Section:
    """One llama.cpp cache of a state, for one seq: the kept cells (in position order, holding
    positions first .. num_tokens - 1) and the model layers it holds, ascending."""

    stream: KvStream
    cell_ids: torch.Tensor
    first: int
    num_tokens: int
    layer_ids: list[int]
    name: str = "base"


def _cache_layers(model: ModelSpec, num_tokens: int) -> list[tuple[list[int], int]]:
    """(layer ids, first position kept) of the base cache and, with sliding layers, of the
    SWA cache: llama.cpp's iSWA split (`llama_kv_cache_iswa`, one n_swa for all)."""
    full = [i for i, x in enumerate(model.layers) if not x.window]
    sliding = [i for i, x in enumerate(model.layers) if x.window]
    if not sliding:
        return [(full, 0)]
    windows = {model.layers[i].window for i in sliding}
    if len(windows) > 1:
        raise UnsupportedTypeError(f"windows {sorted(windows)}: llama.cpp has one n_swa")
    return [(full, 0), (sliding, window_start(windows.pop(), num_tokens))]


def _sections(state: LlamaState, model: ModelSpec, seq_id: int | None) -> list[_Section]:
    has_swa = any(x.window for x in model.layers)
    if has_swa != bool(state.swa_streams):
        raise ModelMismatchError(
            f"the state has {2 if state.swa_streams else 1} KV caches; a model "
            f"{'with' if has_swa else 'without'} sliding layers has "
            f"{'2 (iSWA: base, SWA)' if has_swa else '1'}"
        )
    if seq_id is None:
        seq_id = _only_seq(state)
    base_stream, base_ids = _seq_cells(state.streams, seq_id)
    order = _position_order([base_stream.cells[i] for i in base_ids])
    num_tokens = len(base_ids)
    (full, _), *swa = _cache_layers(model, num_tokens)
    sections = [_Section(base_stream, torch.as_tensor(base_ids)[order], 0, num_tokens, full)]
    if swa:
        sliding, first = swa[0]
        sections.append(_swa_section(state.swa_streams, seq_id, num_tokens, first, sliding))
    return sections


def _swa_section(
    streams: tuple[KvStream, ...], seq_id: int, num_tokens: int, first: int, layer_ids: list[int]
) -> _Section:
    """The SWA cache's cells first .. num_tokens - 1 (it may hold earlier ones too)."""
    stream, ids = _seq_cells(streams, seq_id) if num_tokens else (KvStream(), [])
    cells = [stream.cells[i] for i in ids]
    if any(c.ext for c in cells):
        raise StateFormatError("cells carry M-RoPE positions (x, y, tok); these are not mapped")
    by_pos = {c.pos: i for c, i in zip(cells, ids, strict=True)}
    missing = [p for p in range(first, num_tokens) if p not in by_pos]
    if missing or len(by_pos) != len(cells) or any(p >= num_tokens for p in by_pos):
        raise StateFormatError(
            f"the SWA cache must hold positions {first}..{num_tokens - 1} once each (the "
            f"window of position {num_tokens}) and none past them; it holds "
            f"{min(by_pos, default=None)}..{max(by_pos, default=None)} in {len(cells)} cells"
        )
    kept = torch.tensor([by_pos[p] for p in range(first, num_tokens)], dtype=torch.long)
    return _Section(stream, kept, first, num_tokens, layer_ids, "SWA")


def _only_seq(state: LlamaState) -> int:
    held = {s for st in state.streams for c in st.cells for s in c.seq_ids}
    if len(held) > 1:
        raise StateFormatError(f"the state holds seqs {sorted(held)}; choose one (seq_id=)")
    return next(iter(held), 0)


def _seq_cells(streams: tuple[KvStream, ...], seq_id: int) -> tuple[KvStream, list[int]]:
    found = [(st, [i for i, c in enumerate(st.cells) if seq_id in c.seq_ids]) for st in streams]
    found = [(st, ids) for st, ids in found if ids]
    if len(found) != 1:
        raise StateFormatError(f"seq {seq_id} has cells in {len(found)} streams; expected one")
    return found[0]


def _place(t: StateTensor, spec: Any, cell_ids: torch.Tensor, first: int) -> torch.Tensor:
    """A layer's plane from the state's cells `cell_ids` (positions first ..) as a buffer of
    spec's shape, zeros before `first`."""
    raw = torch.from_numpy(np.array(t.data))  # uint8 copy: [cells, row] or [embd, cells, b]
    if t.transposed:  # V^T -> [H, D, T]
        values = raw.view(spec.dtype).reshape(t.data.shape[0], -1)[:, cell_ids]
        values = values.reshape(*spec.shape[:2], -1)
    else:  # rows -> [T, H, C]
        values = raw[cell_ids].view(spec.dtype).reshape(-1, *spec.shape[1:])
    if first == 0:
        return values
    out = torch.zeros(spec.shape, dtype=spec.dtype)
    (out[..., first:] if t.transposed else out[first:]).copy_(values)
    return out


def _position_order(cells: list[Cell]) -> torch.Tensor:
    if any(c.ext for c in cells):
        raise StateFormatError("cells carry M-RoPE positions (x, y, tok); these are not mapped")
    pos = torch.tensor([c.pos for c in cells])
    order = torch.argsort(pos, stable=True)
    sorted_pos = pos[order]
    expected = torch.arange(len(cells))
    if not torch.equal(sorted_pos, expected):
        bad = int((sorted_pos != expected).nonzero()[0, 0])
        dup = bad > 0 and sorted_pos[bad] == sorted_pos[bad - 1]
        raise StateFormatError(
            f"cell positions must be 0..{len(cells) - 1} exactly once; "
            f"{'duplicate' if dup else 'gap at'} position "
            f"{int(sorted_pos[bad - 1] if dup else expected[bad])}"
        )
    return order


def _stream_format(streams: Sequence[KvStream]) -> LlamaCacheFormat:
    types = {t.ggml_type for st in streams for t in (*st.k, *st.v)}
    if len(types) > 1:
        raise UnsupportedTypeError(
            f"layers of types {sorted(map(_type_name, types))}: a kvabi layout has one dtype"
        )
    if len({st.v_trans for st in streams if st.cells}) > 1:
        raise UnsupportedTypeError("the base and SWA caches differ in v_trans")
    (one,) = types or {1}
    return LlamaCacheFormat(one, one, any(st.v_trans for st in streams))


def _check_geometry(section: _Section, specs: dict[str, Any]) -> None:
    stream, layer_ids = section.stream, section.layer_ids
    if len(stream.k) != len(layer_ids):
        raise ModelMismatchError(
            f"the state's {section.name} cache has {len(stream.k)} KV layers; the model "
            f"{len(layer_ids)}"
        )
    for j, layer_id in enumerate(layer_ids):
        for plane, t in (("k", stream.k[j]), ("v", stream.v[j])):
            _check_plane(t, specs[f"{layer_id}.{plane}"])


def _check_plane(t: StateTensor, spec: Any) -> None:
    elem = torch.empty((), dtype=spec.dtype).element_size()
    want = (
        (spec.shape[0] * spec.shape[1], elem)
        if t.transposed
        else (spec.shape[1] * spec.shape[2] * elem,)
    )
    got = (t.data.shape[0], t.data.shape[2]) if t.transposed else (t.data.shape[1],)
    if want != got:
        what = "(n_embd_v_gqa, elem_bytes)" if t.transposed else "row bytes"
        raise ModelMismatchError(
            f"layer {spec.key}: {what} {got} in the state; the model needs {want}"
        )


def _state_tensor(
    cache: CacheBuffers, spec: Any, fmt: LlamaCacheFormat, first: int = 0
) -> StateTensor:
    """A layer's plane at positions first .. T - 1 as state bytes."""
    t = cache.tensors[spec.key]
    is_v = spec.key.endswith(".v")
    if is_v and fmt.v_trans:  # [H, D, T] -> [H*D, T, elem_bytes]
        raw = t[..., first:].contiguous().view(torch.uint8).numpy()
        elem = t.element_size()
        return StateTensor(
            fmt.type_v, raw.reshape(spec.shape[0] * spec.shape[1], -1, elem), transposed=True
        )
    raw = t[first:].contiguous().view(torch.uint8).numpy()  # [T, H, C]
    return StateTensor(fmt.type_v if is_v else fmt.type_k, raw.reshape(raw.shape[0], -1))


def _type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"ggml type {ggml_type}")
