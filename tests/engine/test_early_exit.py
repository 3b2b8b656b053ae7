"""Early-exit self-speculation: the draft is the target's first E layers (transformers'
`assistant_early_exit`), writing their K/V into the target's own blocks. Greedy tokens equal
decoding without it; drafts equal HF's early-exit model's; the first layers' K/V written by
the draft serve later prefix hits; a sliding-window hybrid and a small budget mix in."""

from __future__ import annotations

import pytest
import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel
from tests.engine.test_hybrid_groups import hybrid_loaded
from tests.engine.test_spec_decode import PROMPTS, greedy, run
from tests.engine.tiny import MIN_MARGIN, greedy_reference, tiny_loaded

EXIT = 2


def damped_loaded(seed: int = 2, layers: int = 4, scale: float = 0.1) -> LoadedModel:
    """A tiny Llama whose layers after EXIT add little to the residual stream, so its early
    exit predicts the full model often, but not always (LayerSkip trains for this). Damped
    before it is loaded: a loaded model's GEMMs hold packed copies of the weights."""
    base = tiny_loaded(seed, layers=layers)
    weights = {name: w.clone() for name, w in base.model.state_dict().items()}
    for i in range(EXIT, layers):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"layers.{i}.{name}.weight"] *= scale
    model = LlamaModel.from_state_dict(base.config, weights)
    return LoadedModel(base.config, model, base.tokenizer)


def engine(loaded, k: int = 3, **config) -> LLMEngine:
    spec = f"early-exit:k={k},exit={EXIT},batch=32"
    return LLMEngine(loaded, EngineConfig(speculative=spec, **config), "t")


class Recorder:
    """Keeps each step's (context, filled draft) from the runner's draft rounds."""

    def __init__(self, eng: LLMEngine) -> None:
        self.seen: list[tuple[list[int], tuple[int, ...]]] = []
        inner = eng.runner.draft

        def draft(batch, exit_layer):
            drafted = inner(batch, exit_layer)
            for s in drafted.batch.seqs:
                if s.draft:
                    self.seen.append((s.seq.token_ids()[: s.start + 1], s.draft))
            return drafted

        eng.runner.draft = draft


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("seed,damped", [(2, False), (2, True), (5, True)])
def test_greedy_tokens_equal_decoding_without_speculation(block_size, seed, damped):
    loaded = damped_loaded(seed) if damped else tiny_loaded(seed, layers=4)
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    eng = engine(loaded, block_size=block_size)
    assert run(eng, PROMPTS, greedy()) == want
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 50
    if damped:  # most drafts right, some wrong: both paths run
        assert 0.5 < stats.num_accepted_tokens / stats.num_draft_tokens < 1.0, stats
    pool = eng.cache.pools[0]
    assert pool.num_free == pool.num_blocks  # every draft's blocks came back


def test_drafts_are_hfs_early_exit_models_greedy_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvabi.models.hf_export import export_hf_folder

    loaded = damped_loaded()
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf_folder(loaded, tmp_path))
    hf.eval().config.num_hidden_layers = EXIT  # how HF's EarlyExitCandidateGenerator exits
    eng = engine(loaded, k=4, block_size=4)
    record = Recorder(eng)
    run(eng, PROMPTS, greedy())
    compared = 0
    for context, draft in record.seen:
        ids = torch.tensor([context])
        with torch.no_grad():
            for token in draft:
                logits = hf(ids).logits[0, -1]
                top = logits.topk(2)
                if float(top.values[0] - top.values[1]) < MIN_MARGIN:
                    break  # a near-tie: either token is the early exit's argmax
                assert token == int(top.indices[0]), (context, draft)
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
                compared += 1
    assert compared > 100


def test_first_layers_kv_written_by_drafts_serves_prefix_hits():
    """The first E layers' K/V of accepted tokens were written only by draft rounds: a
    second request over the first one's output reuses those blocks and must decode the
    reference's tokens."""
    loaded = damped_loaded()
    prompt = PROMPTS[0]
    want = list(greedy_reference(prompt, 40, loaded=loaded))
    eng = engine(loaded, block_size=4)
    first = run(eng, [prompt], greedy(24))[0]
    assert first == want[:24]
    hits = eng.cache_stats()["prefix_hit_tokens"]
    again = run(eng, [prompt + first], greedy(16))[0]
    assert eng.cache_stats()["prefix_hit_tokens"] - hits >= len(prompt) + 20  # drafted blocks
    assert again == want[24:]


def test_a_small_budget_mixes_drafts_with_prefills_and_decodes():
    loaded = damped_loaded()
    want = [list(greedy_reference(p, 24, loaded=loaded)) for p in PROMPTS]
    eng = engine(loaded, block_size=4, max_num_batched_tokens=9)
    kinds: list[set[str]] = []
    inner = eng.runner.draft

    def draft(batch, exit_layer):
        drafted = inner(batch, exit_layer)
        kind = {"draft" if s.draft else "prefill" if s.num_tokens > 1 else "decode"
                for s in drafted.batch.seqs}  # fmt: skip
        kinds.append(kind)
        return drafted

    eng.runner.draft = draft
    assert run(eng, PROMPTS, greedy()) == want
    assert any({"draft", "prefill"} <= k for k in kinds)  # drafts beside a prompt's chunk
    assert any({"draft", "decode"} <= k for k in kinds)  # and beside plain decodes
    assert eng.spec_stats.num_accepted_tokens > 20


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_sliding_window_hybrid_matches(backend):
    loaded = hybrid_loaded()
    want = [list(greedy_reference(p, 20, loaded=loaded)) for p in PROMPTS]
    eng = engine(loaded, block_size=4, attention_backend=backend)
    assert run(eng, PROMPTS, greedy(20)) == want
    assert eng.spec_stats.num_draft_tokens > 30
    for pool in eng.cache.pools:
        assert not any(pool.ref_counts)


def test_sampled_requests_speculate_and_keep_their_tables():
    eng = engine(damped_loaded(), block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=4, ignore_eos=True)
    first = run(eng, PROMPTS, params)
    assert run(eng, PROMPTS, params) == first and all(len(o) == 16 for o in first)
    assert eng.spec_stats.num_accepted_tokens > 0


def test_bad_exits_are_refused():
    loaded = tiny_loaded(layers=4)
    for text in ("early-exit:exit=4", "early-exit:exit=0", "early-exit:k=2", "ngram:exit=2"):
        with pytest.raises(ValueError, match="exit"):
            LLMEngine(loaded, EngineConfig(speculative=text), "t")


@pytest.mark.parametrize("layout", ["vllm-mla", "vllm-fp8-ds-mla"])
def test_an_mla_cache_matches(layout, tmp_path):
    """DeepSeek-V3 MLA (the real 512 + 64 latent geometry), exit 1 of 2 with the second layer
    damped: drafts write layer 0's latents into the paged latent cache (bf16 576 or fp8_ds_mla
    records), verification runs layer 1 only; greedy tokens equal decoding without it."""
    pytest.importorskip("transformers")
    from kvabi.models import load_model
    from tests.models import test_deepseek_v3
    from tests.models.test_registry import _write_tokenizer
    from tests.models.tiny import random_ids

    hf = test_deepseek_v3.make_hf("plain-512")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.startswith("model.layers.1.") and ("o_proj" in name or "down_proj" in name):
                param.mul_(0.1)
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    prompts = [random_ids(n, seed=30 + n).tolist() for n in (13, 6, 9)]
    plain = LLMEngine(loaded, EngineConfig(block_size=4, kv_layout=layout), "t")
    want = run(plain, prompts, greedy(16))
    spec = "early-exit:k=3,exit=1,batch=32"
    eng = LLMEngine(loaded, EngineConfig(block_size=4, kv_layout=layout, speculative=spec), "t")
    assert run(eng, prompts, greedy(16)) == want
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 20
    assert 0.2 < stats.num_accepted_tokens / stats.num_draft_tokens < 1.0, stats
    for pool in eng.cache.pools:
        assert pool.num_free == pool.num_blocks
