"""Speculative decoding with temperature > 0 in the engine: a seeded chi-square test that
each token after a draft follows the target's own distribution (computed here from the model
without paging), and logprobs as decoding without speculation gives them."""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampler import target_probs
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.attention import ContiguousAttention
from tests.engine.chi_square import ALPHA, chi_square_pvalue
from tests.engine.test_spec_decode import PROMPTS, check_tables
from tests.engine.tiny import tiny_loaded

LOADED = tiny_loaded()
PROMPT = tuple(PROMPTS[0])
PARAMS = dict(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)


@cache
@torch.no_grad()
def logits_after(ids: tuple[int, ...]) -> torch.Tensor:
    """The target's float32 logits [vocab] after `ids`, contiguous K/V: no paging, no draft."""
    attn = ContiguousAttention.for_config(LOADED.config)
    return LOADED.model(torch.tensor(ids), torch.arange(len(ids)), attn)[-1].float()


class GreedyProposer:
    """Drafts the target's own argmax continuation: accepted often, never always, when the
    target samples from its top 3."""

    k = 4

    def propose(self, token_ids, max_model_len, k=None):
        ids = tuple(token_ids)
        for _ in range(k or self.k):
            ids += (int(logits_after(ids).argmax()),)
        return list(ids[len(token_ids) :])


def sample_many(num: int) -> list[list[int]]:
    engine = LLMEngine(LOADED, EngineConfig(max_num_seqs=64, speculative="ngram:batch=64"), "t")
    engine.scheduler.proposer = GreedyProposer()
    ids = [engine.add_request(list(PROMPT), SamplingParams(seed=i, **PARAMS)) for i in range(num)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
        check_tables(engine)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > num, stats  # every request verified drafts
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert 0.2 < rate < 0.9, rate  # accepts and rejections both common
    return [got[i] for i in ids]


def test_tokens_after_drafts_follow_the_targets_distribution():
    outputs = sample_many(3000)
    assert all(len(o) == PARAMS["max_tokens"] for o in outputs)
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)  # prefix -> next tokens
    for out in outputs:
        for i in range(1, len(out)):  # token 0 comes from the prefill, without a draft
            groups[tuple(out[:i])].append(out[i])
    params = SamplingParams(**PARAMS)
    checked = [p for p, draws in groups.items() if len(draws) >= 150]
    assert len(checked) >= 8, {p: len(d) for p, d in groups.items()}
    for prefix in checked:
        probs = target_probs(logits_after(PROMPT + prefix), params)
        pvalue = chi_square_pvalue(groups[prefix], probs)
        assert pvalue > ALPHA, (prefix, pvalue)


def test_logprobs_with_drafts_are_the_targets_at_each_position():
    engine = LLMEngine(LOADED, EngineConfig(speculative="ngram:batch=64"), "t")
    engine.scheduler.proposer = GreedyProposer()
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, logprobs=2)
        engine.add_request(list(PROMPT), params)
        out = []
        while engine.has_unfinished():
            out += engine.step()
        lps = [lp for o in out for lp in o.outputs[0].logprobs]
        tokens = [t for o in out for t in o.outputs[0].token_ids]
        assert len(lps) == len(tokens) == 8
        for i, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            want = torch.log_softmax(logits_after(PROMPT + tuple(tokens[:i])), -1)
            assert lp.token_id == token
            assert abs(lp.logprob - float(want[token])) < 1e-4
            assert set(lp.top) == set(want.topk(2).indices.tolist())
    assert engine.spec_stats.num_accepted_tokens > 0
