"""The n-gram proposer against vLLM 0.32's own `_find_longest_matched_ngram_and_propose_tokens`
(run in .venv-vllm), over random, repetitive and edge-case token sequences."""

import json
import random
import subprocess
from pathlib import Path

import pytest

from kvabi.engine.ngram_proposer import NgramProposer

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
VLLM_NGRAM = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
out = []
for tokens, min_n, max_n, max_len, k in json.load(sys.stdin):
    got = _find_longest_matched_ngram_and_propose_tokens(
        np.array(tokens, dtype=np.int32), min_n, max_n, max_len, k)
    out.append(got.tolist())
print("RESULT " + json.dumps(out))
"""


def cases() -> list[tuple[list[int], int, int, int, int]]:
    rng = random.Random(7)
    out = []
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20, 1000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        if rng.random() < 0.3:  # a copied span: what input-grounded prompts look like
            tokens += tokens[: rng.randrange(0, len(tokens) + 1)]
        min_n = rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        max_len = len(tokens) + rng.randrange(0, 6)  # near the end of the context too
        out.append((tokens, min_n, max_n, max_len, rng.randrange(1, 8)))
    out += [
        ([], 1, 3, 10, 4),
        ([5], 1, 3, 10, 4),
        ([5, 5], 1, 3, 10, 4),
        ([1, 2, 1, 2], 2, 2, 4, 3),
    ]
    return out


def test_the_longest_suffix_ngram_wins_at_its_earliest_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 100) == [9, 2, 3]  # 3-gram at 0, not 2-gram
    assert p.propose([4, 7, 5, 4, 7, 6, 4, 7], 100) == [5, 4, 7]  # earliest of two 2-grams
    assert p.propose([1, 2, 3], 100) == []  # nothing earlier
    assert p.propose([1, 2, 1, 2, 9, 1, 2], 100, k=10) == [1, 2, 9, 1, 2]  # up to the end
    assert p.propose([1, 2, 1, 2, 9, 1, 2], 9) == [1, 2]  # max_model_len caps k
    with pytest.raises(ValueError, match="min"):
        NgramProposer(k=3, min_n=3, max_n=2)


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM installed")
def test_proposals_equal_vllms_own_ngram_function():
    jobs = cases()
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_NGRAM],
        input=json.dumps(jobs).encode(),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    line = next(x for x in run.stdout.decode().splitlines() if x.startswith("RESULT "))
    want = json.loads(line[len("RESULT ") :])
    got = [NgramProposer(k, lo, hi).propose(t, max_len) for t, lo, hi, max_len, k in jobs]
    assert sum(1 for w in want if w) > 100  # most cases propose something
    assert got == want
