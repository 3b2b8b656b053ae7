"""`kvabi bench throughput`: kvabi vs HF `generate`, llama.cpp and vLLM, same model and tokens.

Each engine runs in its own process, one after another (never two at once on this 2-core
machine), on a seeded workload: batch 1 (TTFT and decode tokens/s) and 16 concurrent requests
of mixed prompt and output lengths (aggregate tokens/s). Ratios are against HF measured in the
same run. vLLM runs from `.venv-vllm` (scripts/setup_vllm.sh) when present.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from kvabi.abi.table import print_table
from kvabi.bench.report import write_json

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORDS = (
    "the",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "a",
    "prompt",
    "once",
    "and",
    "then",
    "writes",
    "one",
    "at",
    "time",
    "while",
    "cache",
    "keys",
    "values",
    "grows",
    "with",
    "each",
    "step",
    "request",
    "city",
    "river",
    "music",
    "history",
    "of",
    "science",
)


def workload(quick: bool, seed: int = 0) -> dict:
    """Seeded prompts (token ids of generated text) and output lengths."""
    from kvabi.models.registry import bundled_model_path
    from kvabi.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(bundled_model_path())
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(3000))
    corpus = tok.encode(text, add_special_tokens=False)

    def prompt(n: int) -> list[int]:
        start = rng.randrange(len(corpus) - n)
        return corpus[start : start + n]

    p_lo, p_hi, o_lo, o_hi = (32, 256, 16, 64) if quick else (64, 512, 32, 128)
    return {
        "batch1": {"prompt_ids": prompt(200 if quick else 500), "max_tokens": 32 if quick else 64},
        "concurrent": [
            {"prompt_ids": prompt(rng.randint(p_lo, p_hi)), "max_tokens": rng.randint(o_lo, o_hi)}
            for _ in range(16)
        ],
    }


def _run_worker(cmd: list[str], out: Path) -> dict | str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}"
    return json.loads(out.read_text())


def _engines(dtypes: list[str]) -> list[tuple[str, str]]:
    runs = [(e, d) for d in dtypes for e in ("hf", "kvabi")]
    return runs + [("llamacpp", "q4_1"), ("vllm", "bf16")]


def run(quick: bool, json_path: str | None, dtypes: list[str] | None = None) -> dict:
    dtypes = dtypes or (["bf16"] if quick else ["bf16", "fp32"])
    work = workload(quick)
    results: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        wpath = Path(tmp) / "workload.json"
        wpath.write_text(json.dumps(work))
        for engine, dtype in _engines(dtypes):
            out = Path(tmp) / f"{engine}-{dtype}.json"
            results[f"{engine}-{dtype}"] = _run_worker(
                _command(engine, dtype, wpath, out, tmp), out
            )
            print(f"  {engine} ({dtype}): done", file=sys.stderr)
    figures = _figures(results, work, dtypes)
    _print(figures)
    write_json(json_path, figures)
    return figures


def _command(engine: str, dtype: str, wpath: Path, out: Path, tmp: str) -> list[str]:
    if engine != "vllm":
        return [
            sys.executable,
            "-m",
            "kvabi.bench.throughput_workers",
            "--engine",
            engine,
            "--workload",
            str(wpath),
            "--out",
            str(out),
            "--dtype",
            "bf16" if engine == "llamacpp" else dtype,
        ]
    if not VLLM_PYTHON.exists():
        return [
            sys.executable,
            "-c",
            "raise SystemExit('vLLM not installed: run scripts/setup_vllm.sh')",
        ]
    from kvabi.models.hf_export import export_hf_folder
    from kvabi.models.registry import load_model

    folder = export_hf_folder(load_model(dtype=dtype, progress=False), Path(tmp) / "hf")
    return [
        str(VLLM_PYTHON),
        str(ROOT / "kvabi" / "bench" / "vllm_worker.py"),
        "--model-dir",
        str(folder),
        "--workload",
        str(wpath),
        "--out",
        str(out),
        "--dtype",
        "bfloat16" if dtype == "bf16" else "float32",
    ]


def _figures(results: dict, work: dict, dtypes: list[str]) -> dict:
    figures = {
        "workload": {
            "batch1_prompt": len(work["batch1"]["prompt_ids"]),
            "batch1_new": work["batch1"]["max_tokens"],
            "concurrent": len(work["concurrent"]),
        },
        "engines": results,
    }
    for d in dtypes:
        hf, ours = results.get(f"hf-{d}"), results.get(f"kvabi-{d}")
        if isinstance(hf, dict) and isinstance(ours, dict):
            figures[f"{d}_ttft_ratio"] = hf["batch1_ttft_s"] / ours["batch1_ttft_s"]
            figures[f"{d}_decode_ratio"] = ours["batch1_decode_tok_s"] / hf["batch1_decode_tok_s"]
            figures[f"{d}_concurrent_ratio"] = ours["concurrent_tok_s"] / hf["concurrent_tok_s"]
            figures[f"{d}_greedy_tokens_match_hf"] = hf["batch1_tokens"] == ours["batch1_tokens"]
            # in bf16 two correct engines part at a near-tie: how far they agree first
            figures[f"{d}_greedy_tokens_agree_with_hf"] = _agreeing(
                hf["batch1_tokens"], ours["batch1_tokens"]
            )
    return figures


def _agreeing(a: list[int], b: list[int]) -> str:
    """'n/total': how many leading tokens two greedy runs share."""
    same = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"{same}/{max(len(a), len(b))}"


def _print(figures: dict) -> None:
    rows = []
    for name, r in figures["engines"].items():
        if isinstance(r, str):
            rows.append([name, r, "", "", "", ""])
            continue
        rows.append(
            [
                name,
                r["batch1_ttft_s"],
                r["batch1_decode_tok_s"],
                r["concurrent_tok_s"],
                r["concurrent_wall_s"],
                r["peak_rss_mb"],
            ]
        )
    w = figures["workload"]
    print_table(
        f"kvabi bench throughput: SmolLM2-135M, batch 1 = {w['batch1_prompt']}-token "
        f"prompt + {w['batch1_new']} new; {w['concurrent']} concurrent mixed requests",
        ["engine-dtype", "TTFT s", "decode tok/s", "concurrent tok/s", "wall s", "peak RSS MB"],
        rows,
    )
    ratios = [[k, v] for k, v in figures.items() if k.endswith(("_ratio", "_hf"))]
    print_table(
        "kvabi vs HF generate (same run; >1 means kvabi is faster)", ["figure", "value"], ratios
    )
