"""The bundled SmolLM2-135M GGUF: our model against transformers' own GGUF loading (fp32).

Both sides dequantise the same file; the weights come out bit-identical (checked below), so any
logit difference is float32 rounding from different kernels and summation orders. Measured:
max |ours - HF| = 7.8e-5 .. 9.4e-5 on logits whose largest magnitude is ~38-39 (2.4e-6
relative). The bound, 1e-3, leaves 10x headroom for other CPUs/BLAS builds while staying four
orders below what a real defect produces (a wrong RoPE pairing or un-permute moves logits by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from kvabi.models import ContiguousAttention, LoadedModel, load_model
from tests.conftest import assert_argmax_agrees, assert_greedy_agrees

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LOGIT_TOLERANCE = 1e-3
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of copper.",
]
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(progress=False)


@pytest.fixture(scope="module")
def hf(hf_smollm2: torch.nn.Module) -> torch.nn.Module:
    return hf_smollm2


def _chat_ids(ours: LoadedModel, prompt: str) -> list[int]:
    message = [{"role": "user", "content": prompt}]
    ids = ours.tokenizer.apply_chat_template(message, add_generation_prompt=True)
    assert isinstance(ids, list)
    return ids


def test_config_matches_the_machine_facts(ours: LoadedModel) -> None:
    c = ours.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert (c.rope_theta, c.tie_word_embeddings, c.rope_scaling) == (100000.0, True, None)
    assert sum(p.numel() for p in ours.model.parameters()) == 134_515_008


def test_weights_are_bit_identical_to_transformers(ours: LoadedModel, hf: torch.nn.Module) -> None:
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    for name, weight in ours.model.state_dict().items():
        assert torch.equal(weight, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], theirs["embed_tokens.weight"])  # tied


@pytest.mark.parametrize("prompt", PROMPTS)
@torch.inference_mode()
def test_logits_match_transformers(ours: LoadedModel, hf: torch.nn.Module, prompt: str) -> None:
    ids = torch.tensor(_chat_ids(ours, prompt))
    attn = ContiguousAttention.for_config(ours.config)
    logits = ours.model(ids, torch.arange(ids.shape[0]), attn)
    expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    # one position of PROMPTS[2] is 1.9e-3 apart: there the argmax may swap
    assert_argmax_agrees(logits, expected, LOGIT_TOLERANCE)


@torch.inference_mode()
def _greedy(ours: LoadedModel, ids: list[int]) -> list[int]:
    attn = ContiguousAttention.for_config(ours.config)
    tokens, positions, out = torch.tensor(ids), torch.arange(len(ids)), []
    for _ in range(NUM_NEW_TOKENS):
        next_id = int(ours.model(tokens, positions, attn)[-1].argmax())
        out.append(next_id)
        if next_id in ours.stop_token_ids:
            break
        tokens, positions = torch.tensor([next_id]), torch.tensor([attn.num_tokens])
    return out


@torch.inference_mode()
def _hf_greedy(
    hf: torch.nn.Module, ids: list[int], eos: tuple[int, ...]
) -> tuple[list[int], list[float]]:
    """HF's greedy tokens, and each step's top-2 logit margin."""
    prompt = torch.tensor([ids])
    out = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
        return_dict_in_generate=True,
        output_logits=True,
    )
    top2 = [step[0].topk(2).values for step in out.logits]
    return out.sequences[0, len(ids) :].tolist(), [float(t[0] - t[1]) for t in top2]


@pytest.mark.parametrize("prompt", PROMPTS[1:])  # PROMPTS[0] ends after 9 tokens, see below
def test_greedy_16_tokens_match_transformers(
    ours: LoadedModel, hf: torch.nn.Module, prompt: str
) -> None:
    ids = _chat_ids(ours, prompt)
    generated = _greedy(ours, ids)
    assert len(generated) == NUM_NEW_TOKENS
    # logits within LOGIT_TOLERANCE: the tokens may part only at one of HF's near-ties
    assert_greedy_agrees(generated, *_hf_greedy(hf, ids, ours.stop_token_ids), LOGIT_TOLERANCE)


def test_answers_the_capital_question_and_stops(ours: LoadedModel, hf: torch.nn.Module) -> None:
    ids = _chat_ids(ours, PROMPTS[0])
    generated = _greedy(ours, ids)
    assert_greedy_agrees(generated, *_hf_greedy(hf, ids, ours.stop_token_ids), LOGIT_TOLERANCE)
    assert generated[-1] == ours.tokenizer.token_id("<|im_end|>")
    assert ours.tokenizer.decode(generated[:-1]) == "The capital of France is Paris."
