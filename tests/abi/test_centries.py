"""ABI 1.4 compressed entries (`centries`, DeepSeek V4): the descriptor's JSON and text forms,
its checks, the buffers (N / ratio rows per block, a state record per block with overlap),
conversion (rows re-blocked through block tables, state records block for block, another block
size refused) and containers (entries and state whole, the windows' tails; a cache missing its
state plane refused)."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, CENTRIES, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.errors import DescriptorError, IncompatibleError, MissingPlaneError
from kvabi.abi.kv_groups import kv_groups
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.text_form import from_text
from kvabi.wire import container_bytes, read_container

WINDOW = LayerSpec(ATTN, 1, 16, 16, window=8)
CSA = LayerSpec(CENTRIES, latent_dim=16, indexer_dim=8, compresses=1, ratio=4, overlap=True)
HCA = LayerSpec(CENTRIES, latent_dim=16, compresses=2, ratio=8)
LAYERS = (WINDOW, WINDOW, WINDOW, CSA, HCA)
JSON = (
    '{"kvabi":"1.4","layout":{"axes":"BNHC","block_size":8,"dtype":"f32","name":'
    '"kvabi-compressed","planes":"concat","quant":"none","scales":[],"tp_rank":0,"tp_size":1,'
    '"v_axes":""},"model":{"fingerprint":"v4","k_post_rope":true,"layers":[{"k_dim":16,'
    '"kind":"swa","num_kv_heads":1,"v_dim":16,"window":8},{"k_dim":16,"kind":"swa",'
    '"num_kv_heads":1,"v_dim":16,"window":8},{"k_dim":16,"kind":"swa","num_kv_heads":1,'
    '"v_dim":16,"window":8},{"compresses":1,"indexer_dim":8,"kind":"centries","latent_dim":16,'
    '"overlap":true,"ratio":4},{"compresses":2,"kind":"centries","latent_dim":16,'
    '"overlap":false,"ratio":8}],"rope_dim":0,"rope_pairing":"half"}}'
)
TEXT = (
    "kvabi/1.4 layers=3*swa8:1x16,centries@1:4x16+8o,centries@2:8x16 fp=v4 rope=post:half "
    "axes=BNHC bs=8 dtype=f32 planes=concat name=kvabi-compressed"
)


def desc(block_size: int = 8, dtype: str = "f32") -> Descriptor:
    model = ModelSpec(LAYERS, "v4")
    return preset_descriptor("kvabi-compressed", model, block_size=block_size, dtype=dtype)


def filled(d: Descriptor, extent: int) -> CacheBuffers:
    cache = CacheBuffers.empty(d, extent)
    generator = torch.Generator().manual_seed(0)
    for t in cache.tensors.values():
        t.copy_(torch.randint(0, 250, t.shape, generator=generator).to(t.dtype))
    return cache


def test_json_and_text_golden() -> None:
    d = desc()
    assert d.version == (1, 4)
    assert d.to_json() == JSON
    assert Descriptor.from_json(JSON) == d
    assert str(d) == TEXT and from_text(TEXT) == d


def test_buffers_rows_and_state() -> None:
    specs = {s.key: s for s in buffer_specs(desc(), 3)}
    assert specs["3"].shape == (3, 2, 1, 24)  # 8 tokens / 4 = 2 rows of entry (16) | index (8)
    assert specs["4"].shape == (3, 1, 1, 16)  # 8 / 8 = 1 row
    assert specs["3.state"].shape == (3, 4 * 2 * (16 + 8) * 4)  # f32 Ca rows and gates
    assert specs["3.state"].is_sidecar and "4.state" not in specs
    groups = kv_groups(ModelSpec((WINDOW, WINDOW, WINDOW, CSA, HCA, HCA.__class__(
        CENTRIES, latent_dim=16, compresses=0, ratio=8)), "v4"))  # fmt: skip
    assert [g.layer_ids for g in groups] == [(0, 1, 2), (3,), (4, 5)]  # by geometry


def test_checks() -> None:
    model = ModelSpec(LAYERS, "v4")
    with pytest.raises(DescriptorError, match="multiple of"):
        preset_descriptor("kvabi-compressed", model, block_size=12)
    with pytest.raises(DescriptorError, match="not an earlier attention"):
        ModelSpec((WINDOW, CSA), "v4")  # layer 1 is the entries themselves
    with pytest.raises(DescriptorError, match="compressed twice"):
        ModelSpec((WINDOW, WINDOW, CSA, CSA), "v4")
    with pytest.raises(DescriptorError, match="not an earlier attention"):
        ModelSpec((CSA, WINDOW), "v4")
    with pytest.raises(DescriptorError, match="ratio"):
        LayerSpec(ATTN, 1, 16, 16, ratio=4)


def test_convert_rows_through_block_tables() -> None:
    src = filled(desc(), 4)
    out = convert(src, desc(dtype="f32"), num_tokens=20, src_block_ids=[3, 1, 2])
    for key in ("3", "4", "3.state"):
        assert torch.equal(out.tensors[key][:2], src.tensors[key][[3, 1]])
    assert torch.equal(out.tensors["3"][2, 0], src.tensors["3"][2, 0])  # row 4: tokens 16-19


def test_convert_refuses_another_block_size() -> None:
    with pytest.raises(IncompatibleError, match="state at each block's end"):
        convert(filled(desc(), 2), desc(16), num_tokens=16)


def test_container_round_trip_and_a_missing_state() -> None:
    src = filled(desc(), 3)
    data = container_bytes(src, tuple(range(24)))
    back = read_container(data)
    for key in ("3", "4", "3.state"):  # entries and state whole
        assert torch.equal(back.cache.tensors[key], src.tensors[key])
    tail = back.cache.tensors["0"].flatten(0, 1)  # a window layer: its tail's blocks (ABI 5.4)
    assert torch.equal(tail[16:], src.tensors["0"].flatten(0, 1)[16:])
    assert not tail[:16].any()
    without = {k: t for k, t in src.tensors.items() if k != "3.state"}
    with pytest.raises(MissingPlaneError, match="'state'"):
        CacheBuffers(src.desc, without)
