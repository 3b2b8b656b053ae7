"""llama.cpp state bytes <-> kvabi: hand-built buffers per the grammar, then the real library."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvabi.abi.convert import convert, read_planes
from kvabi.abi.descriptor import LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import (
    InteropError,
    ModelMismatchError,
    StateFormatError,
    StateMagicError,
    StateTruncatedError,
    UnsupportedTypeError,
)
from kvabi.interop.llamacpp_model import LlamaCacheFormat, buffers_to_state, state_to_buffers
from kvabi.interop.llamacpp_state import parse_state, write_state
from kvabi.interop.model_spec import (
    gguf_fingerprint,
    model_spec_from_gguf,
    model_spec_from_gguf_metadata,
)
from tests.conftest import bundled_gguf_path

H, D, L = 2, 32, 2  # the worked example of kv-layouts.md 3.2: 2 layers, 2 KV heads, head_dim 32
MODEL = ModelSpec(layers=(LayerSpec(num_kv_heads=H, k_dim=D, v_dim=D),) * L, rope_pairing="pairs")
SLOT_POS = [5, 0, 7, 1, 6, 2, 4, 3]  # cell positions in slot order, as after seq_rm / reuse
F16, F32, BF16, Q8_0 = 1, 0, 30, 8


def values(seed: int, cells: int = 8) -> np.ndarray:
    """Per layer and plane: [L, cells, H*D] f32 values exact in f16 and bf16."""
    gen = np.random.default_rng(seed)
    return (gen.integers(-128, 128, (L, cells, H * D)) / 16).astype(np.float32)


def state_bytes(
    positions: list[int],
    v_trans: bool,
    form: str = "seq-v3",
    ggml_type: int = F16,
    seq_ids: list[tuple[int, ...]] | None = None,
    k=None,
    v=None,
) -> bytes:
    """A one-stream state written field by field from the grammar, independently of the code."""
    k = values(1, len(positions)) if k is None else k
    v = values(2, len(positions)) if v is None else v
    out = {
        "seq-v3": struct.pack("<Ii", 0xAF143CD8, 0),
        "seq-v2": b"",
        "full": struct.pack("<I", 5) + b"llama",
    }[form]
    out += struct.pack("<II", 1, len(positions))
    for pos, ids in zip(positions, seq_ids or [(0,)] * len(positions), strict=True):
        out += struct.pack(f"<iI{len(ids)}i", pos, len(ids), *ids)
    out += struct.pack("<II", int(v_trans), L)
    for layer in k:
        rows = encode(layer, ggml_type)
        out += struct.pack("<iQ", ggml_type, len(rows) // len(positions)) + rows
    for layer in v:
        if v_trans:
            elem_bytes = 4 if ggml_type == F32 else 2
            vt = encode(np.ascontiguousarray(layer.T), ggml_type)  # [H*D][cells]
            out += struct.pack("<iII", ggml_type, elem_bytes, H * D) + vt
        else:
            rows = encode(layer, ggml_type)
            out += struct.pack("<iQ", ggml_type, len(rows) // len(positions)) + rows
    return out


def encode(rows: np.ndarray, ggml_type: int) -> bytes:
    if ggml_type == Q8_0:
        from gguf import GGMLQuantizationType, quants

        return quants.quantize(rows, GGMLQuantizationType.Q8_0).tobytes()
    if ggml_type == BF16:
        return (rows.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return rows.astype(np.float16 if ggml_type == F16 else np.float32).tobytes()


@pytest.mark.parametrize("v_trans", [False, True])
def test_worked_size_example(v_trans: bool) -> None:
    sizes = {"seq-v2": 4256, "seq-v3": 4264, "full": 4265}
    for form, size in sizes.items():
        data = state_bytes(list(range(8)), v_trans, form)
        assert len(data) == size
        state = parse_state(data, "full" if form == "full" else "seq")
        assert (state.form, state.arch) == (form, "llama" if form == "full" else "")
        (stream,) = state.streams
        assert [c.pos for c in stream.cells] == list(range(8)) and stream.v_trans == v_trans
        assert [t.ggml_type for t in stream.k + stream.v] == [F16] * 4
        assert stream.v[0].data.shape == ((H * D, 8, 2) if v_trans else (8, H * D * 2))
        assert write_state(state) == data


@pytest.mark.parametrize("v_trans", [False, True])
def test_cells_map_in_position_order(v_trans: bool) -> None:
    k, v = values(1), values(2)
    cache = state_to_buffers(state_bytes(SLOT_POS, v_trans), MODEL)
    assert cache.desc.layout.name == "llamacpp-f16" + ("-vtrans" if v_trans else "")
    slot_of = [SLOT_POS.index(p) for p in range(8)]
    for layer in range(L):
        planes = read_planes(cache, layer, 8)  # float32 {plane: [T, H, D]}
        assert torch.equal(planes["k"], torch.from_numpy(k[layer, slot_of]).view(8, H, D))
        assert torch.equal(planes["v"], torch.from_numpy(v[layer, slot_of]).view(8, H, D))


def test_to_hf_order_unpairs_k() -> None:
    cache = state_to_buffers(state_bytes(list(range(8)), True), MODEL)
    hf = convert(
        cache,
        preset_descriptor("hf-dynamic", replace(MODEL, rope_pairing="half"), dtype="f32"),
        num_tokens=8,
    )
    k_gg = torch.from_numpy(values(1)[1]).view(8, H, D)
    k_hf = hf.tensors["1.k"]  # [H, T, D]
    for a in (0, 1):
        for i in (0, 5, 15):  # HF element a*D/2 + i is llama.cpp element 2i + a
            assert torch.equal(k_hf[:, :, a * D // 2 + i].T, k_gg[:, :, 2 * i + a])


@pytest.mark.parametrize("v_trans", [False, True])
def test_write_sorts_cells_to_positions(v_trans: bool) -> None:
    cache = state_to_buffers(state_bytes(SLOT_POS, v_trans), MODEL)
    slot_of = [SLOT_POS.index(p) for p in range(8)]
    sorted_bytes = state_bytes(
        list(range(8)), v_trans, k=values(1)[:, slot_of], v=values(2)[:, slot_of]
    )
    assert buffers_to_state(cache, MODEL, LlamaCacheFormat(v_trans=v_trans)) == sorted_bytes
    short = buffers_to_state(
        cache, MODEL, LlamaCacheFormat(v_trans=v_trans), num_tokens=3, form="seq-v2"
    )
    assert short == state_bytes(
        [0, 1, 2], v_trans, "seq-v2", k=values(1)[:, slot_of[:3]], v=values(2)[:, slot_of[:3]]
    )


@pytest.mark.parametrize(
    ("ggml_type", "v_trans", "name"),
    [
        (Q8_0, False, "llamacpp-q8_0"),
        (BF16, False, "llamacpp-bf16"),
        (BF16, True, "llamacpp-bf16-vtrans"),
        (F32, False, "llamacpp-f32"),
    ],
)
def test_other_types_round_trip(ggml_type: int, v_trans: bool, name: str) -> None:
    k, v = values(1), values(2)
    data = state_bytes(list(range(8)), v_trans, ggml_type=ggml_type, k=k, v=v)
    cache = state_to_buffers(data, MODEL)
    assert cache.desc.layout.name == name
    fmt = LlamaCacheFormat(ggml_type, ggml_type, v_trans)
    assert buffers_to_state(cache, MODEL, fmt) == data
    decoded = read_planes(cache, 1, 8)["k"]
    if ggml_type == Q8_0:
        from gguf import GGMLQuantizationType, quants

        raw = np.frombuffer(encode(k[1], Q8_0), np.uint8).reshape(8, -1)
        expected = quants.dequantize(raw, GGMLQuantizationType.Q8_0)
        assert torch.equal(decoded.reshape(8, -1), torch.from_numpy(expected))
    else:
        assert torch.equal(decoded.reshape(8, -1), torch.from_numpy(k[1]))


def test_several_seqs() -> None:
    ids = [(0,), (0, 1), (1,), (0, 1), (0,), (1,), (0,), (1,)]
    positions = [0, 1, 0, 2, 3, 1, 4, 2]  # seq 0: 0..4 (two cells shared), seq 1: 0..2 + shared
    data = state_bytes(positions, True, "full", seq_ids=ids)
    with pytest.raises(StateFormatError, match=r"seqs \[0, 1\]"):
        state_to_buffers(data, MODEL, form="full")
    with pytest.raises(StateFormatError, match="duplicate position 1"):
        state_to_buffers(data, MODEL, seq_id=1, form="full")
    seq0 = state_to_buffers(data, MODEL, seq_id=0, form="full")
    cells = [i for i, x in enumerate(ids) if 0 in x]
    expected = torch.from_numpy(values(1)[0, cells]).view(5, H, D)
    assert torch.equal(read_planes(seq0, 0, 5)["k"], expected)


def test_refusals() -> None:
    good = state_bytes(list(range(8)), False)
    with pytest.raises(StateMagicError, match="io_magic"):
        parse_state(good[8:], "seq-v3")
    with pytest.raises(StateMagicError, match="io_magic"):
        parse_state(good, "seq-v2")
    with pytest.raises(StateMagicError, match="n_stream"):
        parse_state(b"\xef\xbe\xad\xde" + good[8:], "seq")
    for cut in [0, 3, 11, 20, 120, 150, len(good) - 1]:
        with pytest.raises((StateTruncatedError, StateMagicError)):
            parse_state(good[:cut])
    with pytest.raises(StateTruncatedError, match="K layer 0"):
        parse_state(good[:150])
    with pytest.raises(StateFormatError, match="1 trailing"):
        parse_state(good + b"\0")
    gap = state_bytes([0, 1, 2, 3, 5, 6, 7, 8], False)
    with pytest.raises(StateFormatError, match="gap at position 4"):
        state_to_buffers(gap, MODEL)
    with pytest.raises(StateFormatError, match="gap at position 0"):
        state_to_buffers(state_bytes(list(range(1, 9)), False), MODEL)


def test_model_and_type_refusals() -> None:
    good = state_bytes(list(range(8)), True)
    with pytest.raises(ModelMismatchError, match="2 KV layers; the model 3"):
        state_to_buffers(good, replace(MODEL, layers=MODEL.layers + MODEL.layers[:1]))
    wide = replace(MODEL, layers=(LayerSpec(num_kv_heads=3, k_dim=D, v_dim=D),) * L)
    with pytest.raises(ModelMismatchError, match=r"row bytes \(128,\)"):
        state_to_buffers(good, wide)
    k_type = bytearray(good)
    k_type[8 + 8 + 8 * 12 + 8 : 8 + 8 + 8 * 12 + 12] = struct.pack("<i", 12)  # K layer 0: q4_K
    with pytest.raises(UnsupportedTypeError, match=r"types \['f16', 'ggml type 12'\]"):
        state_to_buffers(bytes(k_type), MODEL)
    with pytest.raises(UnsupportedTypeError, match="ggml type 12 has no kvabi preset"):
        buffers_to_state(state_to_buffers(good, MODEL), MODEL, LlamaCacheFormat(12, 12))
    with pytest.raises(UnsupportedTypeError, match="K type q8_0 != V type f16"):
        buffers_to_state(state_to_buffers(good, MODEL), MODEL, LlamaCacheFormat(8, 1))
    with pytest.raises(UnsupportedTypeError, match="never transposes"):
        buffers_to_state(state_to_buffers(good, MODEL), MODEL, LlamaCacheFormat(8, 8, True))


def test_gguf_spec_and_fingerprint(tmp_path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in [
        ("block_count", 2),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("embedding_length", 64),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.rope.dimension_count", 16)
    b = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = np.array([1, 2, 3, 4], dtype=np.float16)
    writer.add_tensor("b.weight", b)
    writer.add_tensor("a.weight", a)
    for step in (
        writer.write_header_to_file,
        writer.write_kv_data_to_file,
        writer.write_tensors_to_file,
        writer.close,
    ):
        step()
    digest = hashlib.sha256()  # a.weight before b.weight; dims in ggml order (ne0 first)
    digest.update(b"a.weight\0" + struct.pack("<IIQQ", F16, 1, 4, 8) + a.tobytes())
    digest.update(b"b.weight\0" + struct.pack("<IIQQQ", F32, 2, 3, 2, 24) + b.tobytes())
    assert gguf_fingerprint(path) == "gguf-sha256:" + digest.hexdigest()
    spec = model_spec_from_gguf(path)
    assert spec.fingerprint == "gguf-sha256:" + digest.hexdigest()
    assert spec.layers == (LayerSpec(num_kv_heads=2, k_dim=16, v_dim=16),) * 2
    assert (spec.rope_pairing, spec.rope_dim) == ("pairs", 0)
    as_strings = {
        "general.architecture": "llama",
        "llama.block_count": "2",
        "llama.attention.head_count": "4",
        "llama.attention.head_count_kv": "2",
        "llama.embedding_length": "64",
        "llama.rope.dimension_count": "8",
    }
    from_strings = model_spec_from_gguf_metadata(as_strings, spec.fingerprint)
    assert from_strings == replace(spec, rope_dim=8)
    qwen = {**as_strings, "general.architecture": "qwen2"}
    qwen = {k.replace("llama.", "qwen2."): v for k, v in qwen.items()}
    assert model_spec_from_gguf_metadata(qwen, "x").rope_pairing == "half"
    with pytest.raises(InteropError, match="pass rope_pairing"):
        model_spec_from_gguf_metadata({**qwen, "general.architecture": "mystery"}, "x")


# ---- the real library: llama-cpp-python 0.3.36 with the bundled SmolLM2-135M Q4_1 ----

CONFIGS = {  # (flash_attn, ggml type of K and V); q8_0 needs flash attention
    "f16-vtrans": (False, F16),
    "f16": (True, F16),
    "q8_0": (True, Q8_0),
}
PROMPT = b"Once upon a time, in a small village,"
NUM_NEW = 16


@pytest.fixture(scope="module")
def real():
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvabi.interop.model_spec import model_spec_from_llama

    path = bundled_gguf_path()
    contexts = {}

    def pair(name: str):
        if name not in contexts:
            flash_attn, ggml_type = CONFIGS[name]
            kw = dict(
                model_path=str(path),
                n_ctx=512,
                flash_attn=flash_attn,
                type_k=ggml_type,
                type_v=ggml_type,
                verbose=False,
                n_threads=1,  # see THREADS in test_cross_engine.py
            )
            contexts[name] = (llama_cpp.Llama(**kw), llama_cpp.Llama(**kw))
        return contexts[name]

    first = pair("f16-vtrans")[0]
    # a stand-in fingerprint: the file hash costs seconds and is tested on a tiny GGUF above
    return (
        pair,
        model_spec_from_llama(first, fingerprint="test"),
        first.tokenize(PROMPT, add_bos=False),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_real_state_round_trip_and_restore(real, name: str) -> None:
    from kvabi.interop.llamacpp_context import (
        cache_format,
        get_seq_state,
        greedy_tokens,
        restore_sequence,
    )

    pair, model, tokens = real
    source, target = pair(name)
    source.reset()
    source.eval(tokens)
    data = get_seq_state(source)
    reference = greedy_tokens(source, NUM_NEW)
    state = parse_state(data)
    assert (state.form, len(state.streams[0].cells)) == ("seq-v3", len(tokens))
    assert write_state(state) == data
    cache = state_to_buffers(state, model)
    assert cache.desc.layout.name == "llamacpp-" + name
    assert buffers_to_state(cache, model, cache_format(source)) == data
    restore_sequence(target, cache, model, tokens)
    # Exact: the same f16 K/V bits, and llama.cpp computes each token's row alone with the same
    # dot products whatever the batch (its first logits here equal the prefill's bit for bit).
    assert greedy_tokens(target, NUM_NEW) == reference


@pytest.mark.slow
def test_real_full_state_and_refusal(real) -> None:
    import ctypes

    import llama_cpp

    from kvabi.interop.llamacpp_context import cache_format, get_seq_state, set_seq_state

    pair, model, tokens = real
    source, target = pair("f16-vtrans")
    source.reset()
    source.eval(tokens)
    size = llama_cpp.llama_state_get_size(source.ctx)
    buf = (ctypes.c_uint8 * size)()
    full = bytes(buf[: llama_cpp.llama_state_get_data(source.ctx, buf, size)])
    state = parse_state(full, "full")
    assert state.arch == "llama" and write_state(state) == full
    cache = state_to_buffers(state, model)
    assert buffers_to_state(cache, model, cache_format(source), form="full") == full
    flipped = replace(cache_format(target), v_trans=False)
    with pytest.raises(InteropError, match="refused"):
        set_seq_state(target, buffers_to_state(cache, model, flipped))
    set_seq_state(target, buffers_to_state(cache, model, cache_format(target)))
    assert get_seq_state(target) == get_seq_state(source)
