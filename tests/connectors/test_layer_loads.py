"""`LayerLoads`: a forward's loads placed layer group by layer group on a thread; each layer's
wait returns once its own group is placed, a failed load raises before any layer reads it."""

import threading

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.catalog import catalog_model
from kvabi.abi.presets import preset_descriptor
from kvabi.connectors import layer_loads
from kvabi.connectors.layer_loads import LayerLoads, Load
from kvabi.interop.vllm_cache import write_sequence

MODEL = catalog_model("smollm2-135m")
STORE = preset_descriptor("vllm-flash-attn", MODEL, block_size=16, dtype="bf16")
VLLM = preset_descriptor("vllm-cpu-vec", MODEL, block_size=128, dtype="bf16")


def _store_blocks(n: int, seed: int) -> CacheBuffers:
    g = torch.Generator().manual_seed(seed)
    blocks = CacheBuffers.empty(STORE, n, "zeros")
    for t in blocks.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g))
    return blocks


@pytest.mark.parametrize("background", [True, False])
def test_the_placed_blocks_are_a_synchronous_loads(background):
    loads = [Load([3, 1], _store_blocks(16, 1)), Load([5], _store_blocks(8, 2))]
    want = CacheBuffers.empty(VLLM, 7, "zeros")
    for load in loads:
        write_sequence(load.blocks, want, load.block_ids, 128 * len(load.block_ids))
    got, pipeline = CacheBuffers.empty(VLLM, 7, "zeros"), LayerLoads()
    pipeline.start(loads, got, background=background)
    for layer in range(MODEL.num_layers):
        pipeline.wait(layer)
    pipeline.finish()
    pipeline.close()
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    assert pipeline.load_s > 0


def test_a_layer_waits_for_its_own_group_only(monkeypatch):
    placed, gates = [], [threading.Event() for _ in range(8)]

    def slow(src, cache, block_ids, num_tokens, layer_ids):  # group g waits for gate g
        group = layer_ids[0] // 4
        assert gates[group].wait(10)
        placed.append(group)

    monkeypatch.setattr(layer_loads, "write_sequence", slow)
    pipeline = LayerLoads(group_layers=4)
    pipeline.start([Load([1], _store_blocks(8, 3))], CacheBuffers.empty(VLLM, 2), True)
    gates[0].set()
    pipeline.wait(3)  # layers 0-3: group 0
    assert placed == [0]
    waiting = threading.Thread(target=pipeline.wait, args=(5,))  # group 1: not placed yet
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and placed == [0]
    gates[1].set()
    waiting.join(10)
    assert not waiting.is_alive() and placed == [0, 1]
    for gate in gates:
        gate.set()
    pipeline.finish()
    assert placed == list(range(8))  # 30 layers: groups 0-7, in layer order
    pipeline.close()


def test_a_failed_load_raises_in_the_waits_of_the_layers_it_had_not_placed(monkeypatch):
    def broken(src, cache, block_ids, num_tokens, layer_ids):
        if 8 in layer_ids:
            raise RuntimeError("disk gone")

    monkeypatch.setattr(layer_loads, "write_sequence", broken)
    pipeline = LayerLoads(group_layers=4)
    pipeline.start([Load([1], _store_blocks(8, 4))], CacheBuffers.empty(VLLM, 2), True)
    pipeline.wait(0)  # group 0 was placed
    with pytest.raises(RuntimeError, match="disk gone"):
        pipeline.wait(9)
    with pytest.raises(RuntimeError, match="disk gone"):
        pipeline.finish()
    pipeline.finish()  # the next step starts clean
    pipeline.close()
