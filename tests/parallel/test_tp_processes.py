"""Tensor parallelism over real processes (gloo over TCP): SmolLM2 in fp32 gives the same
greedy tokens at TP = 2 and 3 as at TP = 1, with requests batched and n-gram drafts; a rank
that dies fails the next step with TPError instead of hanging; ranks holding another model
are refused at start-up; what TP does not run yet is refused before a process starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.tp_group import TPError, TPGroup, agreement
from tests.server.tiny_server import tiny_folder

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "Repeat exactly: red, green, blue, red, green, blue, red,",
    "def fibonacci(n):",
]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    llm = LLM(MODEL, dtype="fp32", progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("size,spec", [(2, None), (3, "ngram:k=4,batch=8")])
def test_greedy_tokens_equal_tp1(want, size, spec) -> None:
    llm = LLM(MODEL, dtype="fp32", progress=False, tensor_parallel_size=size, speculative=spec)
    try:
        assert [w.poll() for w in llm.engine.tp.workers] == [None] * (size - 1)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == want
        assert llm.engine.cache.storages[0].desc.model.layers[0].num_kv_heads == 3 // size + (
            1 if 3 % size else 0
        )  # rank 0's share of the 3 KV heads: 2 of them at TP 2, 1 at TP 3
        if spec:
            assert llm.engine.spec_stats.num_accepted_tokens > 0
    finally:
        llm.engine.close()
    assert all(w.returncode == 0 for w in llm.engine.tp.workers)  # told to stop, they did


def test_a_dead_rank_fails_the_step_and_never_hangs() -> None:
    llm = LLM(MODEL, dtype="fp32", progress=False, tensor_parallel_size=2)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
        llm.engine.tp.workers[0].kill()
        llm.engine.tp.workers[0].wait()
        start = time.monotonic()
        with pytest.raises(TPError, match="rank 1"):
            llm.generate(PROMPTS[:1], PARAMS)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.close()


def test_ranks_holding_another_model_are_refused(tmp_path: Path) -> None:
    other = tiny_folder(tmp_path / "tiny")  # the workers load this; rank 0 claims SmolLM2
    group = TPGroup.launch(str(other), "fp32", 2, timeout_s=30)
    with pytest.raises(TPError, match="rank 1 holds another fingerprint"):
        group.agree(agreement("smollm2-digest", "a plan", "fp32"))
    group.close()
    assert group.workers[0].returncode == 2  # told why, it left


def test_what_tp_does_not_run_yet_is_refused_before_any_process_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match="ngram only"):
        LLM(MODEL, progress=False, tensor_parallel_size=2, speculative="early-exit:exit=4")
    with pytest.raises(ValueError, match=">= 1"):
        LLM(MODEL, progress=False, tensor_parallel_size=0)


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_kvabi_serve_with_two_ranks_answers_and_fails_cleanly_when_one_dies(want) -> None:
    """`kvabi serve --tensor-parallel-size 2`: the `openai` client gets TP 1's tokens; once the
    worker rank is killed, a request fails with a 5xx that says why and /health turns 503."""
    import os
    import signal

    import httpx

    openai = pytest.importorskip("openai")
    from kvabi.server.launch import ServerProcess

    args = ["--model", MODEL, "--dtype", "fp32", "--tensor-parallel-size", "2"]
    with ServerProcess([*args, "--log-level", "warning"], startup_timeout_s=180) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        from kvabi.models.registry import load_model

        tokenizer = load_model(MODEL, "fp32", progress=False).tokenizer  # TP 1's tokens' text
        out = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.choices[0].text == tokenizer.decode(want[0])
        (worker,) = _children(server.process.pid)
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5)
        assert failed.value.status_code >= 500
        assert "rank 1" in str(failed.value.body)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
