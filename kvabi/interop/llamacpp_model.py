"""llama.cpp KV state <-> kvabi `CacheBuffers` (the `llamacpp-*` presets), and live contexts.

A state holds no head counts or head dims; they come from the model (`model_spec_from_gguf`).
Reading keys on each cell's `pos` (slot order is not position order), so one seq's cells must
hold positions 0..T-1 exactly once. Writing emits positions 0..T-1 in the target context's
exact format (`LlamaCacheFormat`): llama.cpp refuses any other n_layer, v_trans, type or size.
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
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import (
    InteropError,
    ModelMismatchError,
    StateFormatError,
    UnsupportedTypeError,
)
from kvabi.interop.llamacpp_state import Cell, KvStream, LlamaState, StateTensor, parse_state
from kvabi.interop.llamacpp_state import write_state as _write

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

    Cells are put in position order; positions must be exactly 0..T-1. `seq_id=None` takes
    the state's only seq. Raises ModelMismatchError when layer count or sizes disagree with
    `model`, UnsupportedTypeError for types without a preset.
    """
    if not isinstance(state, LlamaState):
        state = parse_state(state, form)
    stream, cell_ids = _seq_cells(state, seq_id)
    desc = llamacpp_descriptor(model, _stream_format(stream))
    order = _position_order([stream.cells[i] for i in cell_ids])
    picked = torch.as_tensor(cell_ids)[order]
    specs = buffer_specs(desc, len(cell_ids))
    _check_geometry(stream, specs, len(model.layers))
    tensors = {}
    for spec, t in zip(specs, _interleave(stream.k, stream.v), strict=True):
        raw = torch.from_numpy(np.array(t.data))  # uint8 copy: [cells, row] or [embd, cells, b]
        if t.transposed:
            values = raw.view(spec.dtype).reshape(t.data.shape[0], -1)[:, picked]
            tensors[spec.key] = values.reshape(spec.shape)  # [H, D, T]
        else:
            tensors[spec.key] = raw[picked].view(spec.dtype).reshape(spec.shape)  # [T, H, C]
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
    """
    desc = llamacpp_descriptor(model, fmt)
    if num_tokens is None:
        if cache.desc.layout.is_paged:
            raise InteropError(
                "a paged cache does not say how many tokens it holds: give num_tokens"
            )
        num_tokens = cache.extent
    out = convert(cache, desc, num_tokens=num_tokens, src_block_ids=block_ids)
    cells = tuple(Cell(pos, (seq_id,)) for pos in range(num_tokens))
    planes = [_state_tensor(out, spec, fmt) for spec in buffer_specs(desc, num_tokens)]
    stream = KvStream(cells, fmt.v_trans, tuple(planes[0::2]), tuple(planes[1::2]))
    streams = [KvStream()] * fmt.n_stream
    streams[seq_id if fmt.n_stream > 1 else 0] = stream if num_tokens else KvStream()
    return _write(LlamaState(tuple(streams), form, seq_id, arch))


def _seq_cells(state: LlamaState, seq_id: int | None) -> tuple[KvStream, list[int]]:
    held = {s for st in state.streams for c in st.cells for s in c.seq_ids}
    if seq_id is None:
        if len(held) > 1:
            raise StateFormatError(f"the state holds seqs {sorted(held)}; choose one (seq_id=)")
        seq_id = next(iter(held), 0)
    found = [
        (st, [i for i, c in enumerate(st.cells) if seq_id in c.seq_ids]) for st in state.streams
    ]
    found = [(st, ids) for st, ids in found if ids]
    if len(found) != 1:
        raise StateFormatError(f"seq {seq_id} has cells in {len(found)} streams; expected one")
    return found[0]


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


def _stream_format(stream: KvStream) -> LlamaCacheFormat:
    types = {t.ggml_type for t in stream.k} | {t.ggml_type for t in stream.v}
    if len(types) > 1:
        raise UnsupportedTypeError(
            f"layers of types {sorted(map(_type_name, types))}: a kvabi layout has one dtype"
        )
    (one,) = types or {1}
    return LlamaCacheFormat(one, one, stream.v_trans)


def _check_geometry(stream: KvStream, specs: list, num_layers: int) -> None:
    if len(stream.k) != num_layers:
        raise ModelMismatchError(f"the state has {len(stream.k)} KV layers; the model {num_layers}")
    for spec, t in zip(specs, _interleave(stream.k, stream.v), strict=True):
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


def _state_tensor(cache: CacheBuffers, spec: Any, fmt: LlamaCacheFormat) -> StateTensor:
    t = cache.tensors[spec.key].contiguous()
    is_v = spec.key.endswith(".v")
    raw = t.view(torch.uint8).numpy()
    if is_v and fmt.v_trans:  # [H, D, T] -> [H*D, T, elem_bytes]
        elem = t.element_size()
        return StateTensor(
            fmt.type_v, raw.reshape(spec.shape[0] * spec.shape[1], -1, elem), transposed=True
        )
    return StateTensor(fmt.type_v if is_v else fmt.type_k, raw.reshape(spec.shape[0], -1))


def _interleave(k: Sequence[StateTensor], v: Sequence[StateTensor]) -> list[StateTensor]:
    return [t for pair in zip(k, v, strict=True) for t in pair]


def _type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"ggml type {ggml_type}")
