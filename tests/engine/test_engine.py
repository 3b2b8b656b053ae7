import dataclasses

import pytest

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from tests.engine.tiny import EOS, greedy_reference, run_all, tiny_engine, tiny_loaded

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 31)), [200] * 9, list(range(40, 47)), [3]]


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens alone, every step clear of a near-tie (see tiny.py): the
    engine's batches round differently, and must still give these tokens exactly."""
    return [greedy_reference(p, 12) for p in PROMPTS]


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("backend", ["native", "batched", "reference"])
def test_paged_batched_greedy_equals_contiguous_reference(layout, block_size, backend, reference):
    engine = tiny_engine(kv_layout=layout, block_size=block_size, attention_backend=backend)
    outs = run_all(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_chunked_prefill_and_continuous_batching_give_each_sequence_its_own_tokens(reference):
    engine = tiny_engine(block_size=4, max_num_batched_tokens=5, max_num_seqs=3)
    outs = run_all(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_a_prompt_longer_than_the_token_budget_prefills_in_steps_that_sample_nothing(reference):
    engine = tiny_engine(block_size=4, max_num_batched_tokens=5)  # 21 tokens: 5 steps alone
    outs = run_all(engine, [PROMPTS[1]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[1]]


def test_preemption_under_a_tiny_block_budget_completes_everything_identically(reference):
    engine = tiny_engine(block_size=4, num_blocks=12)  # 48 slots for ~110 tokens of work
    outs = run_all(engine, PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert engine.cache.pool.num_free == 12


def test_late_arrivals_join_running_batches(reference):
    engine = tiny_engine(block_size=4)
    first, outputs = engine.add_request(PROMPTS[1], GREEDY), OutputAccumulator()
    for _ in range(3):
        outputs.add(engine.step())
    second = engine.add_request(PROMPTS[0], GREEDY)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in outputs.add(engine.step())}
    assert done[first].outputs[0].token_ids == reference[1]
    assert done[second].outputs[0].token_ids == reference[0]


def test_n_shares_the_prompt_blocks_and_seeds_reproduce():
    engine = tiny_engine(block_size=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    rid = engine.add_request(PROMPTS[1], params)  # 21 tokens: 5 full blocks
    outputs = OutputAccumulator()
    while not engine.requests[rid][0].output_ids:
        outputs.add(engine.step())
    seqs = engine.requests[rid]
    assert len(seqs) == 3
    shared = seqs[0].block_ids[:5]
    assert all(s.block_ids[:5] == shared for s in seqs[1:])
    assert [engine.cache.pool.ref_counts[b] for b in shared] == [3] * 5
    while engine.has_unfinished():
        out = outputs.add(engine.step())
    texts = [c.token_ids for c in out[0].outputs]
    assert len(set(texts)) > 1  # three different samples
    again = run_all(tiny_engine(block_size=16), [PROMPTS[1]], params)[0]
    # same seeds, other block size: the probabilities move by ~1e-6, too little to change a
    # draw unless its uniform falls that close to a bucket's edge (as in test_isolation.py)
    assert [c.token_ids for c in again.outputs] == texts
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_greedy_n_gives_identical_copies(reference):
    out = run_all(
        tiny_engine(block_size=4),
        [PROMPTS[3]],
        SamplingParams(max_tokens=12, temperature=0, n=3, ignore_eos=True),
    )[0]
    assert [c.token_ids for c in out.outputs] == [reference[3]] * 3


def test_stop_rules_and_logprobs(reference):
    engine = tiny_engine()
    want = reference[1]
    stop_at = want[4]
    out = run_all(
        engine,
        [PROMPTS[1]],
        SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=(stop_at,), logprobs=3, ignore_eos=True
        ),
    )[0]
    c = out.outputs[0]
    first = want.index(stop_at)
    assert c.token_ids == want[: first + 1] and c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.token_ids)
    for lp in c.logprobs:
        assert max(lp.top.values()) == lp.logprob and lp.token_id in lp.top
    text = engine.tokenizer.decode(list(want))
    stop = text[3:5]
    out = run_all(
        engine,
        [PROMPTS[1]],
        SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True),
    )[0]
    assert out.outputs[0].text == text[: text.find(stop)]
    assert out.outputs[0].finish_reason == "stop"


def test_eos_stops_unless_ignored(reference):
    engine = tiny_engine()
    assert engine.info.eos_token_ids == (EOS,)
    engine.info = dataclasses.replace(engine.info, eos_token_ids=(reference[0][2],))
    out = run_all(engine, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.outputs[0].token_ids == reference[0][:3] and out.outputs[0].finish_reason == "stop"
    out = run_all(engine, [PROMPTS[0]], GREEDY)[0]  # ignore_eos
    assert out.outputs[0].token_ids == reference[0]


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], GREEDY, "prompt"),
        (list(range(1, 200)) * 3, GREEDY, "prompt"),
        ([999], GREEDY, "prompt"),
    ],
)
def test_bad_input_is_refused_before_any_work(prompt, params, field):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: .*got"):
        SamplingParams(**kwargs)


def test_abort_frees_blocks():
    engine = tiny_engine(block_size=4)
    rid = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert engine.cache.pool.num_free < engine.cache.pool.num_blocks
    engine.abort(rid)
    assert (
        engine.cache.pool.num_free == engine.cache.pool.num_blocks and not engine.has_unfinished()
    )


def test_a_sliding_window_model_attends_within_its_window_past_it():
    loaded = tiny_loaded()
    windowed = dataclasses.replace(
        loaded, config=dataclasses.replace(loaded.config, sliding_window=8)
    )
    engine = LLMEngine(windowed, EngineConfig(block_size=4), fingerprint="tiny")
    assert engine.info.max_model_len == 512  # no longer capped at the window
    prompt = list(range(40, 60))  # 20 tokens: past the 8-token window
    out = run_all(engine, [prompt], GREEDY)[0].outputs[0]
    assert tuple(out.token_ids) == greedy_reference(prompt, GREEDY.max_tokens, loaded=windowed)


def test_engines_sharing_a_loaded_model_cannot_change_each_others_paths():
    """The model is prepared (packed, fused, kernels) when it is loaded, not by the first
    engine built over it: an engine on the reference backend first changes nothing."""
    from kvabi.native.cpu_kernels import cpu_kernels

    loaded = tiny_loaded()
    model = loaded.model

    def paths() -> list[object]:
        gemms = [g for layer in model.layers for g in (layer.self_attn.qkv, layer.mlp.gate_up)]
        return [model.logits, *gemms, *(layer.kernels for layer in model.layers)]

    prepared = paths()
    assert model.layers[0].kernels is cpu_kernels() and model.logits is not None
    LLMEngine(loaded, EngineConfig(attention_backend="reference", fused_decode=False))
    LLMEngine(loaded, EngineConfig())
    assert all(a is b for a, b in zip(paths(), prepared, strict=True))
