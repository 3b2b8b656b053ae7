"""vLLM CPU_ATTN presets against vLLM's packing formulas, filled element by element.

vLLM 0.32.0 (`cpu_attn.py`): a layer's cache is `[num_blocks, H, N, 2D]`; per (block, head)
the first N*D elements are K and the rest V, packed for the ISA (csrc/cpu/cpu_attn_*.hpp).
The same formulas were checked against a running vLLM (tests/interop/test_vllm_handoff.py).
"""

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.presets import PRESETS, preset_descriptor

L, H, D, T = 2, 2, 32, 75
MODEL = ModelSpec((LayerSpec(ATTN, H, D, D),) * L, "m")
COVERED = ("vllm-cpu-vec", "vllm-cpu-amx")


def vec_offset(plane: str, o: int, d: int, bs: int) -> int:
    """isa vec (fp32): K transposed [D][bs], V row-major [bs][D]."""
    return d * bs + o if plane == "k" else bs * D + o * D + d


def amx_offset(plane: str, o: int, d: int, bs: int) -> int:
    """isa amx (bf16): K [bs/16][D/2][16][2], V [D/16][bs/2][16][2]."""
    if plane == "k":
        return (o // 16) * 16 * D + (d // 2) * 32 + (o % 16) * 2 + d % 2
    return bs * D + (d // 16) * bs * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2


OFFSETS = {"vllm-cpu-vec": vec_offset, "vllm-cpu-amx": amx_offset}


def _engine_cache(name: str, values: dict, bs: int, block_table: list[int]) -> torch.Tensor:
    """[L, num_blocks, H, bs, 2D] as vLLM fills it, by the formula, one element at a time."""
    dtype = torch.float32 if name == "vllm-cpu-vec" else torch.bfloat16
    cache = torch.zeros(L, max(block_table) + 1, H, bs * 2 * D, dtype=dtype)
    for layer in range(L):
        for t in range(T):
            block, o = block_table[t // bs], t % bs
            for plane in ("k", "v"):
                for d in range(D):
                    offset = OFFSETS[name](plane, o, d, bs)
                    cache[layer, block, :, offset] = values[f"{layer}.{plane}"][t, :, d]
    return cache.view(L, -1, H, bs, 2 * D)


@pytest.mark.parametrize("name", COVERED)
@pytest.mark.parametrize("bs", [32, 128])
def test_preset_matches_vllm_packing(name, bs):
    g = torch.Generator().manual_seed(1)
    values = {
        f"{l}.{p}": torch.randn(T, H, D, generator=g).bfloat16().float()
        for l in range(L)
        for p in "kv"
    }
    block_table = [3, 1, 4][: -(-T // bs)]  # block 0 is never used by vLLM
    want = _engine_cache(name, values, bs, block_table)
    desc = preset_descriptor(name, MODEL, block_size=bs)
    src = CacheBuffers(Descriptor(MODEL, Layout("THC", 0, "f32", planes="separate")), values)
    out = CacheBuffers.empty(desc, want.shape[1], "zeros")
    got = convert(src, desc, num_tokens=T, dst_block_ids=block_table, out=out)
    for layer in range(L):
        assert torch.equal(got.tensors[str(layer)].reshape(want[layer].shape), want[layer])
    back = convert(got, src.desc, num_tokens=T, src_block_ids=block_table)
    assert all(torch.equal(back.tensors[k], v) for k, v in values.items())


def test_presets_are_data_with_vllm_defaults():
    vec, amx = PRESETS["vllm-cpu-vec"].layout, PRESETS["vllm-cpu-amx"].layout
    assert (vec.axes, vec.v_axes, vec.block_size, vec.dtype) == ("BHKCN", "BHKNC", 128, "f32")
    assert (amx.axes, amx.v_axes, amx.block_size, amx.dtype) == (
        "BHKNCn16c2",
        "BHKCNc16n2",
        128,
        "bf16",
    )
    # vLLM's tensor [num_blocks, H, bs, 2D] is the buffer [num_blocks, H, 2, bs*D]: same bytes
    desc = preset_descriptor("vllm-cpu-amx", MODEL)
    cache = CacheBuffers.empty(desc, 5)
    assert cache.tensors["0"].shape == (5, H, 2, 128 * D)
