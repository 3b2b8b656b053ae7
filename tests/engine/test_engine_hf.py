"""The engine on the bundled SmolLM2 against HF transformers on the same GGUF (fp32).

Greedy outputs must be token-identical on 8 varied prompts x 64 new tokens, with the cache in
each selectable layout and with 4-token blocks. The first-step logits must agree within 1e-3
(the weights are bit-identical; differences are fp32 summation order: ~1e-4 measured). So the
tokens may part only at a step where HF's own top-2 margin is under 2e-3, which either engine
may break either way (none here: the smallest of the 512 is 2.5e-3; another CPU's GEMMs may
move HF's margins too).
"""

from __future__ import annotations

import pytest
import torch

from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from tests.conftest import assert_greedy_agrees

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Think step by step.",
    "Write a haiku about autumn rain.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
]
NEW_TOKENS = 64
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def hf_ref(
    prompts: list[list[int]], hf_smollm2: torch.nn.Module
) -> tuple[list[tuple[int, ...]], list[list[float]], list[torch.Tensor]]:
    """HF's greedy tokens for every prompt with each step's top-2 logit margin, and its
    next-token logits for the first two prompts."""
    hf = hf_smollm2
    # HF's own greedy loop over its own cache (generate would stop at EOS, or with
    # min_new_tokens mask it): 64 tokens each, EOS included wherever the model picks it.
    out, margins = [], []
    with torch.no_grad():
        for ids in prompts:
            step = hf(torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            margins.append([])
            for _ in range(NEW_TOKENS):
                top = step.logits[0, -1].topk(2).values
                margins[-1].append(float(top[0] - top[1]))
                tokens.append(int(step.logits[0, -1].argmax()))
                step = hf(
                    torch.tensor([tokens[-1:]]),
                    past_key_values=step.past_key_values,
                    use_cache=True,
                )
            out.append(tuple(tokens))
        first_logits = [hf(torch.tensor([ids])).logits[0, -1] for ids in prompts[:2]]
    return out, margins, first_logits


@pytest.mark.parametrize("layout, block_size", [("nhd", 16), ("hnd", 16), ("nhd", 4)])
def test_greedy_tokens_equal_hf(llm, prompts, hf_ref, layout, block_size):
    engine_llm = LLM.from_loaded(llm.engine.loaded, kv_layout=layout, block_size=block_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = engine_llm.generate(prompts, params)
    for out, want, margins in zip(outs, *hf_ref[:2], strict=True):
        assert_greedy_agrees(out.outputs[0].token_ids, want, margins, LOGIT_TOLERANCE)


def test_first_step_logits_within_tolerance(llm, prompts, hf_ref):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    for ids, hf_logits in zip(prompts[:2], hf_ref[2], strict=True):
        out = llm.generate([ids], params)[0].outputs[0]
        hf_logp = torch.log_softmax(hf_logits, -1)
        for token, lp in out.logprobs[0].top.items():
            assert abs(lp - float(hf_logp[token])) < LOGIT_TOLERANCE
