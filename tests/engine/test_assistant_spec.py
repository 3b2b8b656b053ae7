"""Speculation with Gemma 4's assistant drafter reading the target's paged cache
(`speculative="assistant:k=K"`, `draft_model=`): greedy tokens equal decoding without it, HF's
greedy decoding and HF's assisted generation with the same assistant; every draft the engine
makes equals HF's candidate generator's over the same tokens, with prompts longer than the
windows (the sliding groups' blocks released, bar the slack the assistant reads); concurrent
requests, sampling, n > 1, and the refusals."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import ScheduledBatch, ScheduledSeq
from kvabi.engine.sequence import Sequence
from kvabi.models import load_model
from kvabi.models.errors import CheckpointError
from tests.engine.test_spec_decode import check_tables, greedy, run
from tests.engine.tiny import tiny_loaded
from tests.models import test_gemma4, test_gemma4_assistant
from tests.models.test_gemma4_assistant import hf_drafts, make_assistant
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
K = test_gemma4_assistant.NUM_DRAFT  # HF's num_assistant_tokens, fixed for this assistant
MAX_TOKENS = 12
VOCAB = test_gemma4.COMMON["vocab_size"]
# past both variants' windows (target 4 and 6, assistant 3 and 5): blocks get released
PROMPTS = [random_ids(n, seed=s).tolist() for n, s in ((23, 1), (9, 2), (31, 3))]


class Pair:
    def __init__(self, variant: str, ordered: bool, folder: Path) -> None:
        self.variant = variant
        self.hf_target = test_gemma4.make_hf(variant)
        self.hf_assistant = make_assistant(variant, ordered)
        self.hf_target.save_pretrained(folder / "target")
        write_tokenizer(folder / "target")
        self.hf_assistant.save_pretrained(folder / "assistant")
        self.target = load_model(folder / "target", progress=False)
        self.assistant_folder = str(folder / "assistant")

    def engine(self, **config: Any) -> LLMEngine:
        spec = f"assistant:k={K},batch=32"
        config = {"draft_model": self.assistant_folder, "speculative": spec, **config}
        return LLMEngine(self.target, EngineConfig(**config), "t")

    def hf_greedy(self, ids: list[int], assisted: bool) -> list[int]:
        extra = {"assistant_model": self.hf_assistant} if assisted else {}
        ids_ = torch.tensor([ids])  # an explicit mask: a prompt may hold the pad id (0)
        mask = torch.ones_like(ids_)
        out = self.hf_target.generate(
            ids_, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False, **extra
        )
        return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=[("shared-kv", True), ("moe-softcap", False)])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    variant, ordered = request.param
    return Pair(variant, ordered, tmp_path_factory.mktemp(variant))


class Recorder:
    """Keeps each step's (tokens up to P, the assistant's draft) from its fills; with a
    `script` (the reference tokens after each prompt), the batch is then given drafts whose
    first `rights[i]` tokens are right and the rest wrong, so the next drafts follow accepted
    tokens (a random assistant's own are rarely accepted)."""

    def __init__(self, eng: LLMEngine, script: dict[tuple[int, ...], list[int]] | None = None):
        self.seen: list[tuple[list[int], tuple[int, ...]]] = []
        self.rights = itertools.cycle([K, 2, 0, 1, 3])
        inner = eng.assistant.fill

        def fill(batch: ScheduledBatch) -> ScheduledBatch:
            filled = inner(batch)
            seqs = []
            for s in filled.seqs:
                if s.draft:
                    self.seen.append((s.seq.token_ids()[: s.start + 1], s.draft))
                    if script is not None:
                        s = replace(s, draft=self._scripted(s, script[tuple(s.seq.prompt_ids)]))
                seqs.append(s)
            return replace(filled, seqs=tuple(seqs))

        eng.assistant.fill = fill

    def _scripted(self, s: ScheduledSeq, want: list[int]) -> tuple[int, ...]:
        done, right = len(s.seq.output_ids), next(self.rights)
        draft = want[done : done + len(s.draft)]
        return tuple(t if i < right else (t + 1) % VOCAB for i, t in enumerate(draft))


def check_drafts(pair: Pair, record: Recorder) -> None:
    for context, draft in record.seen:
        want, _ = hf_drafts(pair.hf_target, pair.hf_assistant, context)
        assert list(draft) == want[: len(draft)], (len(context), draft, want)


def test_greedy_tokens_equal_hfs_greedy_and_assisted_generation(pair: Pair) -> None:
    want = [pair.hf_greedy(p, assisted=False) for p in PROMPTS]
    assert [pair.hf_greedy(p, assisted=True) for p in PROMPTS] == want
    plain = LLMEngine(pair.target, EngineConfig(block_size=4), "t")
    assert run(plain, PROMPTS, greedy(MAX_TOKENS)) == want
    eng = pair.engine(block_size=4)
    assert run(eng, PROMPTS, greedy(MAX_TOKENS)) == want
    assert eng.spec_stats.num_draft_tokens >= 3 * K  # every request speculated
    for pool in eng.cache.pools:
        assert pool.num_free == pool.num_blocks  # every draft's blocks came back


@pytest.mark.parametrize("block_size", [1, 4])
def test_each_draft_equals_hfs_candidate_generator(pair: Pair, block_size: int) -> None:
    """Each request alone and all three together (a padded batch); block sizes that put the
    windows' edges anywhere in a block: the assistant's drafts equal HF's over the same tokens,
    after its own (mostly rejected) drafts."""
    want = [pair.hf_greedy(p, assisted=False) for p in PROMPTS]
    for batch in [[p] for p in PROMPTS] + [PROMPTS]:
        eng = pair.engine(block_size=block_size)
        record = Recorder(eng)
        assert run(eng, batch, greedy(MAX_TOKENS)) == [want[PROMPTS.index(p)] for p in batch]
        assert len(record.seen) >= len(batch) * MAX_TOKENS // (K + 1)
        check_drafts(pair, record)


@pytest.mark.parametrize("block_size", [1, 4])
def test_drafts_after_accepted_tokens_equal_hfs(pair: Pair, block_size: int) -> None:
    """Scripted drafts accept K, 2, 0, 1, 3 tokens in turn: the assistant drafts next from the
    hidden state of the last accepted position and the keys of every accepted token."""
    want = {tuple(p): pair.hf_greedy(p, assisted=False) for p in PROMPTS}
    eng = pair.engine(block_size=block_size)
    record = Recorder(eng, want)
    assert run(eng, PROMPTS, greedy(MAX_TOKENS)) == list(want.values())
    stats = eng.spec_stats
    assert 0.3 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.8, stats
    check_drafts(pair, record)


def test_sliding_groups_keep_the_keys_the_assistant_reads(pair: Pair) -> None:
    """A sliding group's released blocks stop `window_slack` keys before the target's own
    window would: the assistant's sliding layers read window + 1 keys before P (its own
    window), the target's query at P the last window - 1. With no slack kept, the assistant
    finds a released block (block size 1: every key its own block)."""
    text = pair.hf_assistant.config.text_config
    target_window = test_gemma4.CONFIGS[pair.variant]["sliding_window"]
    eng = pair.engine(block_size=1)
    slack = text.sliding_window + 1 - (target_window - 1)
    assert eng.scheduler.window_slack == slack
    budget = {"block_size": 1, "max_num_batched_tokens": 8, "kv_cache_bytes": 2**20}
    plain = LLMEngine(pair.target, EngineConfig(**budget), "t").info.pool_blocks
    spec = pair.engine(**budget).info.pool_blocks  # the budget counts the slack
    (sliding,) = {g.pool_id for g in eng.cache.groups if g.window}
    assert spec[sliding] / sum(spec) > plain[sliding] / sum(plain), (spec, plain)
    released: list[int] = []
    inner = eng.scheduler._release_window

    def release(seq: Sequence) -> None:
        inner(seq)
        released.append(sum(b < 0 for table in seq.block_tables for b in table))

    eng.scheduler._release_window = release
    assert run(eng, PROMPTS[:1], greedy(MAX_TOKENS)) == [pair.hf_greedy(PROMPTS[0], False)]
    assert max(released) > 0  # the prompt is past the windows: blocks were released
    eng = pair.engine(block_size=1)
    eng.scheduler.window_slack = 0
    with pytest.raises(RuntimeError, match="freed"):
        run(eng, PROMPTS[:1], greedy(MAX_TOKENS))


def test_sampled_requests_are_seeded_and_their_logprobs_the_targets(pair: Pair) -> None:
    """Temperature 1 with a seed: the same tokens twice; each token's logprob is the target's
    (HF's, over the tokens before it), drafts or not; n = 2 forks both speculate."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, logprobs=1)
    runs = []
    for _ in range(2):
        eng = pair.engine(block_size=4)
        eng.add_request(PROMPTS[0], params)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
            check_tables(eng)
        runs.append(
            (
                [t for o in outs for t in o.outputs[0].token_ids],
                [lp.logprob for o in outs for lp in o.outputs[0].logprobs],
            )
        )
        assert eng.spec_stats.num_draft_tokens > 0
    assert runs[0] == runs[1]
    tokens, logprobs = runs[0]
    ids = torch.tensor([PROMPTS[0] + tokens])
    with torch.no_grad():
        want = torch.log_softmax(pair.hf_target(ids).logits[0].float(), -1)
    n = len(PROMPTS[0])
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert abs(lp - float(want[n - 1 + i, token])) < 1e-4, i
    eng = pair.engine(block_size=4)
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=2))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        check_tables(eng)
    assert eng.spec_stats.num_draft_tokens >= 2 * K


def test_refusals(pair: Pair, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative=f"assistant:k={K}")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative="ngram:k=2", draft_model=pair.assistant_folder)
    with pytest.raises(ValueError, match="Gemma 4 target"):
        LLMEngine(tiny_loaded(), EngineConfig(speculative="assistant", draft_model="x"), "t")
    other = "moe-softcap" if pair.variant == "shared-kv" else "shared-kv"
    make_assistant(other, ordered=False).save_pretrained(tmp_path / "other")
    with pytest.raises(CheckpointError):
        pair.engine(draft_model=str(tmp_path / "other"))


def test_kvabi_serve_speculates_with_the_assistant(pair: Pair) -> None:
    """`kvabi serve --speculative assistant:k=4 --draft-model PATH` in a real process: the
    `openai` client's greedy completion is HF's; the drafts reach /metrics."""
    openai = pytest.importorskip("openai")
    import httpx

    from kvabi.server.launch import ServerProcess
    from tests.server.test_metrics import scrape

    if pair.variant != "shared-kv":
        pytest.skip("one process is enough")
    target = str(Path(pair.assistant_folder).parent / "target")
    args = ["--model", target, "--dtype", "fp32", "--block-size", "4", "--log-level", "warning"]
    args += ["--speculative", f"assistant:k={K}", "--draft-model", pair.assistant_folder]
    args += ["--served-model-name", "gemma4-tiny"]
    with ServerProcess(args, startup_timeout_s=120) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        out = client.completions.create(
            model="gemma4-tiny",
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        metrics = scrape(httpx.get(f"{server.url}/metrics").text)
    plain = LLMEngine(pair.target, EngineConfig(block_size=4), "t")
    plain.add_request(PROMPTS[0], greedy(MAX_TOKENS))
    outs = []
    while plain.has_unfinished():
        outs += plain.step()
    assert [t for o in outs for t in o.outputs[0].token_ids] == pair.hf_greedy(PROMPTS[0], False)
    assert out.choices[0].text == "".join(o.outputs[0].text for o in outs) != ""
    assert out.usage.completion_tokens == MAX_TOKENS
    assert metrics["kvabi_spec_decode_num_draft_tokens", ()] >= K
