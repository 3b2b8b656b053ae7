"""`kvabi bench spec`: speculative decoding (n-gram prompt lookup; early exit at batch 1)
against plain decoding.

The bundled SmolLM2-135M-Instruct in bf16, greedy, chat-templated prompts of two kinds
(kvabi/bench/spec_prompts.py): input-grounded ones, whose answer copies the prompt, and
open-ended ones. For each kind, at batch 1 (prompts one after another) and 16 concurrent
(the prompts cycled), output tokens per second of one kvabi engine without speculation and
one with `ngram:k=4,min=1,max=3`, both on the same loaded weights, measured in this run;
`*_speedup_ratio` is the second over the first. Also the draft acceptance rate and how many
outputs are token-identical to plain decoding's (bf16 verification runs several positions
through other kernels than one-token decode, so a near-tie may round the other way; the fp32
equality is a test: tests/engine/test_spec_decode.py). Baseline from another engine, same run:
transformers' `generate` at batch 1 with and without `prompt_lookup_num_tokens=4`, and, where
`.venv-vllm` exists (scripts/setup_vllm.sh), vLLM with and without its own n-gram speculation
(the same k, min and max) at both batch sizes (kvabi/bench/vllm_spec_worker.py, run with
vLLM's interpreter on kvabi's HF export of the same weights); `*_vs_vllm_ratio` is kvabi's
speculating tokens/s over vLLM's.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvabi.abi.table import print_table
from kvabi.bench.decode_bench import _ran_on
from kvabi.bench.report import write_json
from kvabi.bench.spec_prompts import PROMPT_SETS
from kvabi.bench.throughput import ROOT, VLLM_PYTHON, hf_folder
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams

SPEC = "ngram:k=4,min=1,max=3"
VLLM_NGRAM = "4,1,3"  # the same k, min, max in vLLM's speculative_config
# SmolLM2 was not trained for early exit (LayerSkip was): its half-depth drafts are a
# measured case of a self-drafter the model does not support, where backoff must limit the cost.
EARLY_EXIT = "early-exit:k=3,exit=15"
BATCHES = (1, 16)


def _prompt_ids(llm: LLM, prompts: tuple[str, ...]) -> list[list[int]]:
    tok = llm.tokenizer
    return [
        list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in prompts
    ]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """All `prompts` at once through the engine; their tokens and the wall seconds."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
    return [got[i] for i in ids], time.perf_counter() - start


def _kvabi(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    stats = llm.engine.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    if batch == 1:
        runs = [_generate(llm, [p], max_tokens) for p in prompts]
        outs, seconds = [o for r in runs for o in r[0]], sum(r[1] for r in runs)
    else:
        outs, seconds = _generate(
            llm, [prompts[i % len(prompts)] for i in range(batch)], max_tokens
        )
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    return {
        "outputs": outs,
        "tok_s": sum(len(o) for o in outs) / seconds,
        "acceptance": accepted / drafted if drafted else 0.0,
        "draft_tokens": drafted,
    }


def _early_exit(
    llm: LLM, prompts: list[list[int]], max_tokens: int, base: dict[str, Any], k: str
) -> dict[str, Any]:
    fast = _kvabi(llm, prompts, 1, max_tokens)
    same = sum(a == b for a, b in zip(base["outputs"], fast["outputs"], strict=True))
    return {
        f"{k}_early_exit_tok_s": fast["tok_s"],
        f"{k}_early_exit_speedup_ratio": fast["tok_s"] / base["tok_s"],
        f"{k}_early_exit_acceptance": fast["acceptance"],
        f"{k}_early_exit_identical_outputs": f"{same}/{len(base['outputs'])}",
    }


def _hf(prompt_sets: dict[str, list[list[int]]], max_tokens: int) -> dict[str, float]:
    """transformers' greedy generate at batch 1, with and without prompt lookup."""
    import transformers

    from kvabi.models.registry import bundled_model_path

    path = bundled_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    ).eval()
    out: dict[str, float] = {}
    for kind, prompts in prompt_sets.items():
        for name, extra in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": 4})):
            tokens, seconds = 0, 0.0
            for p in prompts:
                ids = torch.tensor([p])
                start = time.perf_counter()
                with torch.inference_mode():
                    gen = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, **extra)
                seconds += time.perf_counter() - start
                tokens += gen.shape[1] - len(p)
            out[f"hf_{kind}_{name}_tok_s"] = tokens / seconds
        out[f"hf_{kind}_lookup_speedup_ratio"] = (
            out[f"hf_{kind}_lookup_tok_s"] / out[f"hf_{kind}_plain_tok_s"]
        )
    return out


def _vllm(sets: dict[str, list[list[int]]], max_tokens: int) -> dict[str, Any]:
    """vLLM's tokens/s with and without its n-gram speculation (two worker processes), or
    why it did not run."""
    if not VLLM_PYTHON.exists():
        return {"vllm": "skipped: not installed (run scripts/setup_vllm.sh)"}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = hf_folder("smollm2-135m-instruct", "bf16", Path(tmp) / "hf")
        work = Path(tmp) / "workload.json"
        work.write_text(json.dumps({"sets": sets, "max_tokens": max_tokens, "batches": BATCHES}))
        for mode, extra in (("plain", []), ("ngram", ["--ngram", VLLM_NGRAM])):
            result = Path(tmp) / f"{mode}.json"
            worker = str(ROOT / "kvabi" / "bench" / "vllm_spec_worker.py")
            cmd = [str(VLLM_PYTHON), worker, "--model-dir", str(folder), "--workload", str(work)]
            done = subprocess.run(
                [*cmd, "--out", str(result), *extra], capture_output=True, text=True, timeout=900
            )
            if done.returncode != 0:
                return {"vllm": f"failed ({mode}): {done.stderr.strip().splitlines()[-1:]}"}
            out[mode] = json.loads(result.read_text())
    figures: dict[str, Any] = {"vllm": f"vllm {out['plain']['version']}, ngram {VLLM_NGRAM}"}
    for kind in sets:
        for batch in BATCHES:
            k = f"{kind}_batch{batch}"
            plain, ngram = out["plain"][k], out["ngram"][k]
            figures |= {
                f"vllm_{k}_plain_tok_s": plain["tok_s"],
                f"vllm_{k}_spec_tok_s": ngram["tok_s"],
                f"vllm_{k}_speedup_ratio": ngram["tok_s"] / plain["tok_s"],
                f"vllm_{k}_acceptance": ngram["acceptance"],
            }
    return figures


def run(quick: bool, json_path: str | None) -> dict:
    max_tokens, per_set = (64, 2) if quick else (128, 4)
    plain = LLM(dtype="bf16", progress=False, enable_prefix_caching=False)
    spec = LLM.from_loaded(
        plain.engine.loaded, "bench", speculative=SPEC, enable_prefix_caching=False
    )
    early = LLM.from_loaded(
        plain.engine.loaded, "bench", speculative=EARLY_EXIT, enable_prefix_caching=False
    )
    sets = {k: _prompt_ids(plain, v[:per_set]) for k, v in PROMPT_SETS.items()}
    for llm in (plain, spec, early):  # warm-up: kernels built, allocator grown
        _generate(llm, sets["grounded"][:1], 16)
    figures: dict[str, Any] = {
        "max_tokens": max_tokens, "prompts_per_set": per_set, "spec": SPEC, "early_exit": EARLY_EXIT
    }  # fmt: skip
    for kind, prompts in sets.items():
        for batch in BATCHES:
            base, fast = (_kvabi(llm, prompts, batch, max_tokens) for llm in (plain, spec))
            same = sum(a == b for a, b in zip(base["outputs"], fast["outputs"], strict=True))
            k = f"{kind}_batch{batch}"
            figures |= {
                f"{k}_plain_tok_s": base["tok_s"],
                f"{k}_spec_tok_s": fast["tok_s"],
                f"{k}_speedup_ratio": fast["tok_s"] / base["tok_s"],
                f"{k}_acceptance": fast["acceptance"],
                f"{k}_draft_tokens": fast["draft_tokens"],
                f"{k}_identical_outputs": f"{same}/{len(base['outputs'])}",
            }
            if batch == 1:
                figures |= _early_exit(early, prompts, max_tokens, base, k)
    figures |= _hf(sets, max_tokens)
    figures |= _vllm(sets, max_tokens)
    for kind in sets:
        for batch in BATCHES:
            k = f"{kind}_batch{batch}"
            if f"vllm_{k}_spec_tok_s" in figures:
                figures[f"{k}_vs_vllm_ratio"] = (
                    figures[f"{k}_spec_tok_s"] / figures[f"vllm_{k}_spec_tok_s"]
                )
    hf_path = f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"
    figures["ran_on"] = _ran_on(plain) | {"hf_cpu_path": hf_path}
    _print(figures)
    write_json(json_path, figures)
    return figures


def _print(f: dict[str, Any]) -> None:
    rows = []
    for kind in PROMPT_SETS:
        for batch in BATCHES:
            k = f"{kind}_batch{batch}"
            rows.append(
                [kind, batch, f[f"{k}_plain_tok_s"], f[f"{k}_spec_tok_s"], f[f"{k}_speedup_ratio"],
                 f[f"{k}_acceptance"], f[f"{k}_identical_outputs"]]
            )  # fmt: skip
        k = f"{kind}_batch1"
        rows.append(
            [kind, "1 (early-exit)", f[f"{k}_plain_tok_s"], f[f"{k}_early_exit_tok_s"],
             f[f"{k}_early_exit_speedup_ratio"], f[f"{k}_early_exit_acceptance"],
             f[f"{k}_early_exit_identical_outputs"]]
        )  # fmt: skip
        rows.append(
            [kind, "1 (HF)", f[f"hf_{kind}_plain_tok_s"], f[f"hf_{kind}_lookup_tok_s"],
             f[f"hf_{kind}_lookup_speedup_ratio"], "", ""]
        )  # fmt: skip
        for batch in BATCHES if f"vllm_{kind}_batch1_spec_tok_s" in f else ():
            k = f"vllm_{kind}_batch{batch}"
            rows.append(
                [kind, f"{batch} (vLLM)", f[f"{k}_plain_tok_s"], f[f"{k}_spec_tok_s"],
                 f[f"{k}_speedup_ratio"], f[f"{k}_acceptance"], ""]
            )  # fmt: skip
    print_table(
        f"kvabi bench spec: SmolLM2-135M bf16, greedy, up to {f['max_tokens']} tokens, "
        f"{f['prompts_per_set']} prompts per kind; {f['spec']} (early-exit rows: "
        f"{f['early_exit']}) vs plain decoding (tokens/s)",
        ["prompts", "batch", "plain tok/s", "spec tok/s", "spec/plain", "accepted", "identical"],
        rows,
    )
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()) + [("vllm", f["vllm"])])
