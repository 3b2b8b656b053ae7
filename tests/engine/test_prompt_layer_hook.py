"""`EngineHooks.on_prompt_layer`: called on the engine thread after each layer's K/V of the step
that completes a prompt are stored (and only that step), with those prompts' sequences; the
layer's K/V are already in storage when it runs, and the outputs do not change."""

from __future__ import annotations

import torch

from kvabi.cache.kv_cache import KVCache
from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_loaded


def _engine(hook=None) -> LLMEngine:
    config = EngineConfig(block_size=4, num_blocks=32, max_num_batched_tokens=8)
    return LLMEngine(tiny_loaded(layers=3), config, hooks=EngineHooks(on_prompt_layer=hook))


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {}
    outputs = OutputAccumulator()
    while engine.has_unfinished():
        for out in outputs.add(engine.step()):
            outs[out.request_id] = list(out.outputs[0].token_ids)
    return {i: outs[i] for i in ids}


def test_the_hook_sees_each_layer_of_the_step_that_completes_a_prompt():
    calls, stored = [], []

    def hook(cache: KVCache, layer_id: int, seqs: tuple) -> None:
        calls.append((layer_id, tuple(s.request_id for s in seqs)))
        seq = seqs[0]  # this layer's K/V of every prompt token are in storage now
        k, _ = cache.storage.gather(layer_id, torch.tensor(seq.block_ids), len(seq.prompt_ids))
        stored.append(bool(k.abs().sum(-1).all()))

    engine = _engine(hook)
    outs = _run(engine, [list(range(1, 14)), list(range(20, 25))])  # 13 tokens: 2 chunks of 8
    # step 1: 8 tokens of req-0; step 2: its last 5 (done) + 3 of req-1; step 3: req-1 done
    first, second = outs
    assert calls == [(i, (first,)) for i in range(3)] + [(i, (second,)) for i in range(3)]
    assert stored == [True] * 6
    plain = _run(_engine(), [list(range(1, 14)), list(range(20, 25))])
    assert list(outs.values()) == list(plain.values())  # the hook changes no output
