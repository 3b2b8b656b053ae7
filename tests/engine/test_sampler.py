import math

import pytest
import torch

from kvabi.engine.sampler import sample
from kvabi.engine.sampling_params import SAMPLING_EPS, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.5, -1.0, 2.9])


def _draws(params, n=400):
    gen = torch.Generator().manual_seed(0)
    return [sample(LOGITS, params, gen)[0] for _ in range(n)]


def test_greedy_and_degenerate_filters_pick_the_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), None)[0] == 1
    assert set(_draws(SamplingParams(temperature=1.0, top_k=1))) == {1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.01))) == {1}


def test_top_k_and_top_p_restrict_the_support():
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2))) == {1, 4}
    p = torch.softmax(LOGITS, 0)  # 1: .38, 4: .35, 2: .23 -> top_p .7 keeps {1, 4}
    assert p[1] + p[4] > 0.7 > p[1]
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7))) == {1, 4}
    assert set(_draws(SamplingParams(temperature=1.0))) >= {0, 1, 2, 4}


def test_seeded_generators_reproduce():
    params = SamplingParams(temperature=0.8)
    assert _draws(params, 50) == _draws(params, 50)


def test_logprobs_are_of_the_model_distribution():
    token, lp = sample(LOGITS, SamplingParams(temperature=0, logprobs=2), None)
    logp = torch.log_softmax(LOGITS, 0)
    assert token == 1 and lp.logprob == float(logp[1])
    assert lp.top == {1: float(logp[1]), 4: float(logp[4])}


def test_temperatures_below_the_epsilon_are_greedy_and_top_p_keeps_the_top_token():
    # Before: 1e-300 divided the logits into inf (softmax NaN), and a top_p that rounds to 0
    # in float32 dropped every token: torch.multinomial raised for both.
    for temperature in (1e-300, 5e-324, SAMPLING_EPS / 2):
        params = SamplingParams(temperature=temperature)
        assert params.is_greedy and set(_draws(params, 20)) == {1}
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy
    assert set(_draws(SamplingParams(temperature=1.0, top_p=5e-324), 50)) == {1}
    # the smallest temperature that samples: finite probabilities, all mass on the argmax
    assert set(_draws(SamplingParams(temperature=SAMPLING_EPS), 50)) == {1}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("top_p", 0.0),
        ("stop", ""),
        ("stop", [""]),
        ("cache_salt", ""),
        ("tag", ""),
        ("tag", "x" * 129),
    ],
)
def test_values_that_cannot_be_sampled_or_keyed_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})
