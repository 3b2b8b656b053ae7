"""KV presses in the engine (kvabi/engine/press.py), against NVIDIA kvpress 0.5.5 run in its own
venv (kvabi/bench/kvpress_worker.py, .venv-kvpress): for StreamingLLM and SnapKV at 2x, 4x and
8x, on a tiny random GQA Llama exported as an HF folder, the tokens each layer keeps per KV
head (in kvpress's order) and the greedy tokens after the question are kvpress's, whole prompt
or prefilled in chunks. Without kvpress: blocks freed, nothing cached, a preempted pressed
sequence ends the same, refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from kvabi.engine import press as press_module
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.press import PressConfig, n_kept
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.hf_export import export_hf_folder
from tests.engine.tiny import tiny_loaded

ROOT = Path(__file__).resolve().parents[2]
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
WORKER = ROOT / "kvabi" / "bench" / "kvpress_worker.py"
NEW, QUESTION = 8, 8
CASES = [  # method, ratio, window (snapkv)
    ("streaming", 0.5, 16),
    ("streaming", 0.875, 16),
    ("snapkv", 0.5, 16),
    ("snapkv", 0.75, 16),
    ("snapkv", 0.875, 32),
]


def spec(method: str, ratio: float, window: int) -> str:
    return f"{method}:ratio={ratio},window={window},kernel=5,sinks=4,question={QUESTION}"


def prompt(n: int = 120, seed: int = 7) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(**config: object) -> LLMEngine:
    config = {"block_size": 16, "num_blocks": 64, "max_num_batched_tokens": 512} | config
    return LLMEngine(tiny_loaded(), EngineConfig(**config))


def pressed(
    e: LLMEngine, ids: list[int], press: str | None, num_new: int = NEW
) -> tuple[list[int], dict]:
    """Greedy tokens with the press, and each layer's kept indices [H_kv][n] it chose."""
    kept: dict[int, list[list[int]]] = {}
    choose = press_module.PressJob.choose

    def recording(job, layer_id, q, keys):  # noqa: ANN001
        choose(job, layer_id, q, keys)
        kept[layer_id] = job.kept[layer_id].tolist()

    press_module.PressJob.choose = recording
    try:
        params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True, press=press)
        rid, tokens = e.add_request(ids, params), []
        while e.has_unfinished():
            for out in e.step():
                if out.request_id == rid:
                    tokens += out.outputs[0].token_ids
    finally:
        press_module.PressJob.choose = choose
    return tokens, kept


@pytest.fixture(scope="module")
def kvpress(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if not KVPRESS_PYTHON.exists():
        pytest.skip("kvpress is not installed: scripts/setup_kvpress.sh creates .venv-kvpress")
    folder = tmp_path_factory.mktemp("press")
    export_hf_folder(tiny_loaded(), folder / "tiny")
    cases = [
        {"prompt": prompt(), "press": m, "ratio": r, "window": w, "kernel": 5, "sinks": 4,
         "question": QUESTION, "max_tokens": NEW}
        for m, r, w in CASES
    ]  # fmt: skip
    path = folder / "cases.json"
    path.write_text(json.dumps({"model": str(folder / "tiny"), "cases": cases}))
    done = subprocess.run([str(KVPRESS_PYTHON), str(WORKER), str(path)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["cases"]


@pytest.mark.kvpress
@pytest.mark.parametrize("chunk", [512, 40])
def test_kept_tokens_and_greedy_equal_kvpress(kvpress: list[dict], chunk: int) -> None:
    """Chunks of 40: the context (112 tokens) prefills in 3 steps, the last one holding the
    snapkv window's queries (press_chunk shortens the one before it where needed)."""
    e = engine(max_num_batched_tokens=chunk)
    for (method, ratio, window), theirs in zip(CASES, kvpress, strict=True):
        tokens, kept = pressed(e, prompt(), spec(method, ratio, window))
        context = len(prompt()) - QUESTION
        assert sorted(kept) == [0, 1]  # every layer, each of its 2 KV heads
        for layer_id, heads in kept.items():
            assert len(heads) == 2 and all(len(h) == n_kept(context, ratio) for h in heads)
            assert heads == theirs["kept"][str(layer_id)], (method, ratio, layer_id)
        assert tokens == theirs["tokens"], (method, ratio)


def test_a_press_frees_blocks_and_caches_nothing() -> None:
    e = engine()
    ids = prompt()
    plain, _ = pressed(e, ids, None)
    tokens, _ = pressed(e, ids, spec("snapkv", 0.75, 16))
    assert tokens != plain  # 3 in 4 context tokens gone: the continuation moves
    stats = e.cache_stats()
    assert stats["prefix_hit_tokens"] == 0  # the pressed request computed its context
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                            press=spec("snapkv", 0.75, 16))  # fmt: skip
    e = engine(enable_prefix_caching=False)
    e.add_request(ids, params)
    e.step()  # the context, pressed: 112 tokens -> 28 slots, blocks of 16
    (seq,) = e.scheduler.running
    assert (seq.num_computed, seq.num_pruned, seq.num_slots) == (112, 84, 28)
    assert len(seq.block_ids) == 2 and e.cache.pool.num_free == 62
    while e.has_unfinished():
        e.step()
    assert e.cache.pool.num_free == 64


def test_preempted_pressed_sequence_ends_the_same() -> None:
    """Two older sequences grow past the pool: the newest, pressed one is preempted after its
    press, recomputes its context, presses it again and ends with the tokens it has alone."""
    ids, press = prompt(), spec("streaming", 0.5, 16)
    want, _ = pressed(engine(), ids, press, 40)
    e = engine(num_blocks=14, max_num_seqs=4)
    for seed in (1, 2):
        e.add_request(prompt(40, seed), SamplingParams(max_tokens=100, ignore_eos=True))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, press=press)
    rid = e.add_request(ids, params)
    tokens, preempted = [], 0
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == rid:
                tokens += out.outputs[0].token_ids
        preempted = max(preempted, sum(s.num_preemptions for s in e.requests.get(rid, [])))
    assert preempted > 0
    assert tokens == want


def test_refusals() -> None:
    e = engine()
    for text, match in (
        ("snapkv:ratio=1.0", "ratio"),
        ("lsh:ratio=0.5", "method"),
        ("snapkv:window=4", "ratio="),
        ("snapkv:ratio=0.5,foo=1", "foo"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(press=text)
    with pytest.raises(ValueError, match="at least 65"):
        e.add_request(prompt(40), SamplingParams(press="snapkv:ratio=0.5"))
    with pytest.raises(ValueError, match="n > 1"):
        e.add_request(prompt(), SamplingParams(n=2, press="streaming:ratio=0.5"))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine(max_num_batched_tokens=32).add_request(
            prompt(), SamplingParams(press="snapkv:ratio=0.5,window=64")
        )
    assert PressConfig.parse("streaming:ratio=0.5,question=3").context_len(10) == 7


@pytest.mark.kvpress
@pytest.mark.slow
def test_smollm2_real_weights_keep_and_answer_as_kvpress(tmp_path: Path) -> None:
    """SmolLM2-135M's real weights (fp32, exported as an HF folder for kvpress) on a needle
    haystack, SnapKV at 2x with the question in its window: every layer keeps the same set of
    tokens per head (their order may differ where scores tie: the window's padded scores) and
    the answer is kvpress's token for token."""
    if not KVPRESS_PYTHON.exists():
        pytest.skip("kvpress is not installed: scripts/setup_kvpress.sh creates .venv-kvpress")
    import random

    from kvabi.bench.compress_bench import MODEL, haystack
    from kvabi.models.registry import load_model

    loaded = load_model(MODEL, dtype="fp32", progress=False)
    export_hf_folder(loaded, tmp_path / "smollm2")
    e = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=1024))
    ids, after, _ = haystack(random.Random(3), 600, e, aware=True)
    case = {"prompt": ids, "press": "snapkv", "ratio": 0.5, "window": 64, "kernel": 5,
            "sinks": 4, "question": after, "max_tokens": NEW}  # fmt: skip
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"model": str(tmp_path / "smollm2"), "cases": [case]}))
    done = subprocess.run([str(KVPRESS_PYTHON), str(WORKER), str(path)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (theirs,) = json.loads(done.stdout)["cases"]
    tokens, kept = pressed(e, ids, f"snapkv:ratio=0.5,window=64,kernel=5,question={after}")
    assert sorted(kept) == list(range(30))
    for layer_id, heads in kept.items():
        assert [sorted(h) for h in heads] == [sorted(h) for h in theirs["kept"][str(layer_id)]]
    assert tokens == theirs["tokens"]
