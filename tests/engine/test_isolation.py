"""A request that cannot be sampled or stopped fails alone; its batch and the pool go on."""

from __future__ import annotations

import pytest

import kvabi.engine.engine as engine_module
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from tests.engine.tiny import run_all, tiny_engine

PROMPTS = [[5, 6, 7], list(range(10, 31)), [200] * 9]
GOOD = SamplingParams(max_tokens=10, temperature=0.8, seed=1, ignore_eos=True)
BAD_SEED = 13


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """`sample` raises for requests seeded BAD_SEED (any child of them too), after 3 tokens."""
    real, calls = engine_module.sample, {"n": 0}

    def sample(logits, params, generator):
        if params.seed == BAD_SEED:
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)


@pytest.mark.parametrize("n", [1, 2])
def test_a_failing_request_fails_alone_and_frees_its_blocks(poisoned_sampler, n):
    alone = [o.outputs[0].token_ids for o in run_all(tiny_engine(block_size=4), PROMPTS, GOOD)]
    engine = tiny_engine(block_size=4)
    bad = SamplingParams(max_tokens=10, temperature=0.8, seed=BAD_SEED, n=n, ignore_eos=True)
    bad_id = engine.add_request([9, 9, 9, 9, 9], bad)
    outs = run_all(engine, PROMPTS, GOOD)
    # The batch did not notice. Sampled tokens: another batch moves the probabilities by
    # ~1e-6 (fp32 GEMMs of other row counts), which could change a draw only if its uniform
    # fell that close to a bucket's edge: odds of ~1e-6 a draw, and the seeds are fixed.
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    assert bad_id not in engine.requests and not engine.has_unfinished()
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_a_failure_reaches_the_caller_as_an_errored_output(poisoned_sampler):
    engine = tiny_engine(block_size=4)
    bad = SamplingParams(max_tokens=10, temperature=0.8, seed=BAD_SEED, ignore_eos=True)
    (out,) = run_all(engine, [[9, 9, 9]], bad)
    assert out.finished and out.error.startswith("RuntimeError: probability tensor")
    assert out.outputs[0].finish_reason == "error" and len(out.outputs[0].token_ids) == 3


def _run(engine, requests):
    """Add every (prompt, params), step until done; the outputs in that order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done, outputs = {}, OutputAccumulator()
    while engine.has_unfinished():
        done |= {o.request_id: o for o in outputs.add(engine.step())}
    return [done[i] for i in ids]


def test_unsamplable_looking_values_are_served_in_a_batch():
    # Before: temperature 1e-300 / top_p 5e-324 raised in torch.multinomial, failing the step
    # and every request batched with it.
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tiny_t = SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True)
    tiny_p = SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, seed=3, ignore_eos=True)
    engine = tiny_engine(block_size=4)
    outs = _run(engine, [([1, 2, 3], greedy), ([1, 2, 3], tiny_t), ([1, 2, 3], tiny_p)])
    outs += _run(engine, [(p, GOOD) for p in PROMPTS])
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    want = outs[0].outputs[0].token_ids  # both are the argmax: one token has all the mass
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == want
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_a_request_the_cache_could_never_hold_is_refused_at_admission():
    # Before: admitted, then ended early with finish_reason "length" (silently truncated).
    engine = tiny_engine(block_size=4, num_blocks=16)  # 64 tokens of KV
    with pytest.raises(ValueError, match="^max_tokens: 46 with a 20-token prompt needs KV"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=46))
    (out,) = _run(engine, [(list(range(20)), SamplingParams(max_tokens=45, ignore_eos=True))])
    assert len(out.outputs[0].token_ids) == 45 and out.outputs[0].finish_reason == "length"
