"""`kvabi bench throughput`: kvabi vs HF `generate`, llama.cpp and vLLM, same model and tokens.

Each engine runs in its own process, one after another (never two at once on this 2-core
machine), on a seeded workload: batch 1 (TTFT and decode tokens/s) and 16 concurrent requests
of mixed prompt and output lengths (aggregate tokens/s). Ratios are against HF, vLLM and
llama.cpp measured in the same run (`*_vs_vllm_ratio`, `*_vs_llamacpp_ratio`). The model is a
bundled one by name (default SmolLM2-135M; `gemma3-270m` too): HF and llama.cpp load the same
GGUF as kvabi; llama.cpp runs twice, on the GGUF as shipped (q4_1) and on the same weights
re-encoded in kvabi's dtype (`widen_gguf`), so one comparison is at the same precision. The
dtype `auto` is bf16 where the CPU computes it natively, else fp32 (`parse_dtype`). vLLM runs
from `.venv-vllm` (scripts/setup_vllm.sh) when present, on an HF folder of the same weights.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvabi.abi.table import print_table
from kvabi.bench.report import write_json
from kvabi.models.checkpoint import WEIGHT_DTYPES, parse_dtype
from kvabi.models.gguf_widen import WIDE_TYPES, widen_gguf
from kvabi.models.registry import DEFAULT_MODEL, bundled_model_path

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


@dataclass(frozen=True)
class Sizes:
    batch1_prompt: int
    batch1_new: int
    prompt_range: tuple[int, int]  # the concurrent requests' lengths, drawn uniformly
    new_range: tuple[int, int]


QUICK, FULL = Sizes(200, 32, (32, 256), (16, 64)), Sizes(500, 64, (64, 512), (32, 128))
# Gemma 3 270M is 2x SmolLM2's weights and its 262k-token LM head makes HF's steps slow here:
# `--quick` shrinks to stay about a minute per engine on 2 cores.
QUICK_BY_MODEL = {"gemma3-270m": Sizes(64, 8, (16, 64), (4, 16))}


def workload(quick: bool, seed: int = 0, model: str = DEFAULT_MODEL) -> dict:
    """Seeded prompts (token ids of generated text, in `model`'s vocabulary) and output lengths."""
    from kvabi.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(bundled_model_path(model))
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(3000))
    corpus = tok.encode(text, add_special_tokens=False)

    def prompt(n: int) -> list[int]:
        start = rng.randrange(len(corpus) - n)
        return corpus[start : start + n]

    sizes = QUICK_BY_MODEL.get(model, QUICK) if quick else FULL
    return {
        "batch1": {"prompt_ids": prompt(sizes.batch1_prompt), "max_tokens": sizes.batch1_new},
        "concurrent": [
            {
                "prompt_ids": prompt(rng.randint(*sizes.prompt_range)),
                "max_tokens": rng.randint(*sizes.new_range),
            }
            for _ in range(16)
        ],
    }


def _run_worker(cmd: list[str], out: Path) -> dict | str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
        return str(last) if str(last).startswith("skipped:") else f"failed: {last}"
    return json.loads(out.read_text())


def _engines(dtypes: list[str], model: str) -> list[tuple[str, str]]:
    """HF and kvabi in each dtype; llama.cpp on the GGUF as shipped and re-encoded in each dtype
    (`widen_gguf`: the weights kvabi computes with); vLLM in the first dtype."""
    runs = [(e, d) for d in dtypes for e in ("hf", "kvabi", "llamacpp")]
    return runs + [("llamacpp", gguf_quant(model)), ("vllm", dtypes[0])]


def gguf_quant(model: str) -> str:
    """The bundled GGUF's quantisation from its file name (`q4_1`, `q4_k_m`), for labels."""
    found = re.search(r"q\d(_[a-z0-9]+)*", bundled_model_path(model).stem.lower())
    return found.group(0) if found else "gguf"


def dtype_names(dtypes: list[str] | None) -> list[str]:
    """`--dtype` values as weight dtype names (`auto` resolved for this CPU), deduplicated."""
    names = [_dtype_name(d) for d in dtypes or ["auto"]]
    return list(dict.fromkeys(names))


def _dtype_name(dtype: str) -> str:
    resolved = parse_dtype(dtype)
    return next(n for n in ("bf16", "fp32") if WEIGHT_DTYPES[n] == resolved)


def run(
    quick: bool, json_path: str | None, dtypes: list[str] | None = None, model: str | None = None
) -> dict:
    model, dtypes = model or DEFAULT_MODEL, dtype_names(dtypes)
    work = workload(quick, model=model)
    results: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        wpath = Path(tmp) / "workload.json"
        wpath.write_text(json.dumps(work))
        for engine, dtype in _engines(dtypes, model):
            out = Path(tmp) / f"{engine}-{dtype}.json"
            cmd = _command(engine, dtype, model, wpath, out, tmp)
            results[f"{engine}-{dtype}"] = _run_worker(cmd, out)
            print(f"  {engine} ({dtype}): done", file=sys.stderr)
        paired = paired_batch1(
            [_command(e, dtypes[0], model, wpath, Path(tmp) / f"paired-{e}", tmp) for e in PAIR],
            PAIRED_ROUNDS[quick],
        )
    figures = {"model": model, "dtypes": dtypes} | _figures(
        results, work, dtypes, gguf_quant(model)
    )
    figures |= _paired_figures(paired, dtypes[0])
    _print(figures)
    write_json(json_path, figures)
    return figures


# Batch-1 decode of kvabi and llama.cpp on the same weights, both memory-bound: run minutes
# apart, the host's memory bandwidth moved their ratio by more than the gap between them
# (0.86-1.2 in runs of one session). Paired, both engines stay loaded and run the batch-1
# request in turn, the order alternating each round; each round gives one ratio.
PAIR = ("kvabi", "llamacpp")
PAIRED_ROUNDS = {True: 4, False: 8}


class WorkerGone(Exception):
    """A paired worker ended before answering (the message: its last stderr line)."""


def paired_batch1(commands: list[list[str]], rounds: int) -> list[dict] | str:
    """Start the workers `commands` (in `--serve-batch1` mode) side by side, one idle while
    the other runs; `rounds` rounds of each one's batch-1 figures, in alternating order. A
    worker that fails gives its reason instead."""
    procs = [
        subprocess.Popen(
            [*cmd, "--serve-batch1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd in commands
    ]
    try:
        for proc in procs:  # one at a time: each warms up alone
            _read_until(proc, "ready")
        out = []
        for r in range(rounds):
            figures: list[dict] = [{} for _ in procs]
            for i in range(len(procs))[:: 1 if r % 2 == 0 else -1]:
                procs[i].stdin.write("batch1\n")
                procs[i].stdin.flush()
                figures[i] = json.loads(_read_until(procs[i], "{"))
            out.append(dict(zip(PAIR, figures, strict=True)))
        return out
    except WorkerGone as gone:
        return f"failed: {gone}"
    finally:
        for proc in procs:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _read_until(proc: subprocess.Popen, start: str) -> str:
    """`proc`'s next stdout line that starts with `start` (other output is skipped)."""
    for line in proc.stdout:
        if line.startswith(start):
            return line
    proc.wait()
    err = proc.stderr.read().strip().splitlines()
    raise WorkerGone(err[-1] if err else f"exit code {proc.returncode}")


def _round_ratio(paired_round: dict) -> float:
    """One paired round's kvabi / llama.cpp batch-1 decode tokens/s."""
    return (
        paired_round["kvabi"]["batch1_decode_tok_s"]
        / (paired_round["llamacpp"]["batch1_decode_tok_s"])
    )


def _paired_figures(paired: list[dict] | str, dtype: str) -> dict:
    """The paired rounds' kvabi / llama.cpp batch-1 decode ratios: median, min, max."""
    if isinstance(paired, str):
        return {"paired_batch1": paired}
    ratios = sorted(_round_ratio(r) for r in paired)
    return {
        "paired_batch1": paired,
        f"{dtype}_decode_vs_llamacpp_paired_ratio": statistics.median(ratios),
        f"{dtype}_decode_vs_llamacpp_paired_min_ratio": ratios[0],
        f"{dtype}_decode_vs_llamacpp_paired_max_ratio": ratios[-1],
    }


def _command(engine: str, dtype: str, model: str, wpath: Path, out: Path, tmp: str) -> list[str]:
    worker = [sys.executable, "-m", "kvabi.bench.throughput_workers", "--engine", engine]
    worker += ["--model", model, "--workload", str(wpath), "--out", str(out)]
    if engine == "llamacpp":
        gguf = bundled_model_path(model)
        if dtype in WIDE_TYPES:  # the same weights as kvabi's, at its precision
            wide = Path(tmp) / f"{model}-{dtype}.gguf"
            gguf = wide if wide.exists() else widen_gguf(gguf, wide, dtype)
        return [*worker, "--gguf", str(gguf)]
    if engine != "vllm":
        return [*worker, "--dtype", dtype]
    if not VLLM_PYTHON.exists():
        return [
            sys.executable,
            "-c",
            "raise SystemExit('skipped: vLLM not installed (run scripts/setup_vllm.sh)')",
        ]
    folder = hf_folder(model, dtype, Path(tmp) / "hf")
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


def hf_folder(model: str, dtype: str, out_dir: Path) -> Path:
    """The bundled model as an HF checkpoint folder for vLLM (kvabi's own export: Llama-family
    and Gemma 3; vLLM 0.32's CPU build reads neither GGUF)."""
    from kvabi.models.hf_export import export_hf_folder
    from kvabi.models.registry import load_model

    return export_hf_folder(load_model(model, dtype=dtype, progress=False), out_dir)


def _figures(results: dict, work: dict, dtypes: list[str], quant: str = "q4_1") -> dict:
    figures = {
        "workload": {
            "batch1_prompt": len(work["batch1"]["prompt_ids"]),
            "batch1_new": work["batch1"]["max_tokens"],
            "concurrent": len(work["concurrent"]),
        },
        "engines": results,
        "ran_on": _ran_on(results, dtypes),
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
        figures |= _peer_ratios(results, d, quant)
    return figures


def _peer_ratios(results: dict, dtype: str, quant: str) -> dict:
    """kvabi in `dtype` against the peers measured in the same run: vLLM (same weights and
    dtype), llama.cpp on the same weights in `dtype` and on the GGUF's own quantisation."""
    ours, out = results.get(f"kvabi-{dtype}"), {}
    peers = {"vllm": f"vllm-{dtype}", "llamacpp": f"llamacpp-{dtype}"}
    peers[f"llamacpp_{quant}"] = f"llamacpp-{quant}"
    for label, key in peers.items():
        peer = results.get(key)
        if not (isinstance(ours, dict) and isinstance(peer, dict)):
            continue
        for figure, field in (
            ("decode", "batch1_decode_tok_s"),
            ("concurrent", "concurrent_tok_s"),
        ):
            out[f"{dtype}_{figure}_vs_{label}_ratio"] = ours[field] / peer[field]
    return out


def _ran_on(results: dict, dtypes: list[str]) -> dict:
    """The CPU and kernel paths, from the kvabi worker (decode_bench's `_ran_on`), and the
    CPU features llama.cpp and torch (HF) report."""
    ours = results.get(f"kvabi-{dtypes[0]}")
    ran_on = dict(ours.get("ran_on", {})) if isinstance(ours, dict) else {}
    for name, r in results.items():
        if isinstance(r, dict) and "cpu_path" in r:
            ran_on[f"{name.split('-')[0]}_cpu_path"] = r["cpu_path"]
    return ran_on


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
            rows.append([name, r[:60], "", "", "", ""])
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
        f"kvabi bench throughput: {figures['model']}, batch 1 = {w['batch1_prompt']}-token "
        f"prompt + {w['batch1_new']} new; {w['concurrent']} concurrent mixed requests",
        ["engine-dtype", "TTFT s", "decode tok/s", "concurrent tok/s", "wall s", "peak RSS MB"],
        rows,
    )
    paired = figures.get("paired_batch1")
    if isinstance(paired, list):
        print_table(
            "batch-1 decode tok/s, paired: both engines loaded, taking turns (order alternating)",
            ["round", *PAIR, "ratio"],
            [
                [i + 1, *(r[e]["batch1_decode_tok_s"] for e in PAIR), _round_ratio(r)]
                for i, r in enumerate(paired)
            ],
        )
    ratios = [[k, v] for k, v in figures.items() if k.endswith(("_ratio", "_hf"))]
    print_table(
        "kvabi vs HF generate (same run; >1 means kvabi is faster)", ["figure", "value"], ratios
    )
    ran_on = [[k, str(v)[:100]] for k, v in figures["ran_on"].items()]
    print_table("ran on", ["what", "value"], ran_on)
