"""`kvabi bench spec`'s vLLM worker in vLLM's own interpreter: its n-gram speculation drafts and
counts acceptances through vLLM's own counters (a renamed counter would read as no drafts),
plain decoding drafts nothing, and both decode the prompts greedily."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvabi.bench.spec_bench import VLLM_NGRAM, _prompt_ids
from kvabi.bench.spec_prompts import PROMPT_SETS
from kvabi.bench.throughput import ROOT, VLLM_PYTHON, hf_folder
from kvabi.models import load_model
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = VLLM_MARKS


def test_worker_measures_vllms_ngram_speculation(tmp_path: Path) -> None:
    loaded = load_model("smollm2-135m-instruct", dtype="bf16", progress=False)
    sets = {k: _prompt_ids(loaded, v[:1]) for k, v in PROMPT_SETS.items()}
    work = tmp_path / "workload.json"
    work.write_text(json.dumps({"sets": sets, "max_tokens": 24, "batches": [1, 2]}))
    folder = hf_folder("smollm2-135m-instruct", "bf16", tmp_path / "hf")
    figures = {}
    for mode, extra in (("plain", []), ("ngram", ["--ngram", VLLM_NGRAM])):
        out = tmp_path / f"{mode}.json"
        cmd = [str(VLLM_PYTHON), str(ROOT / "kvabi/bench/vllm_spec_worker.py")]
        cmd += ["--model-dir", str(folder), "--workload", str(work), "--out", str(out), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        figures[mode] = json.loads(out.read_text())
    grounded = figures["ngram"]["grounded_batch1"]
    assert grounded["draft_tokens"] > 0 and 0 < grounded["acceptance"] <= 1, grounded
    for kind in sets:
        for batch in (1, 2):
            plain = figures["plain"][f"{kind}_batch{batch}"]
            assert plain["draft_tokens"] == 0 and plain["tok_s"] > 0
            assert len(plain["outputs"]) == batch and all(plain["outputs"])
