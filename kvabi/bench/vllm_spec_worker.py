"""vLLM's side of `kvabi bench spec`: greedy decoding with and without vLLM's n-gram
speculation (`speculative_config={"method": "ngram", ...}`), figures to JSON.

Standalone: imports only the stdlib and vllm, and runs with vLLM's own interpreter
(`scripts/setup_vllm.sh` makes it), never imported by kvabi:

    .venv-vllm/bin/python kvabi/bench/vllm_spec_worker.py --model-dir DIR --workload W.json \
        --out OUT.json [--ngram K,MIN,MAX]

Workload: {"sets": {"grounded": [[ids...], ...], "open": [...]}, "max_tokens": 64,
"batches": [1, 16]}. Batch 1 runs the prompts one after another, batch B the prompts cycled to
B in one `generate` call; prefix caching is off, everything runs once untimed first. The
acceptance rate comes from vLLM's own counters (`vllm:spec_decode_num_*`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: no __main__ guard games
    "HF_HUB_OFFLINE": "1",  # the model is a local folder; never reach for the hub
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _counters(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out and hasattr(metric, "value"):
            out[name] += float(metric.value)
    return out


def _measure(vllm: Any, llm: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    cycled = [prompts[i % len(prompts)] for i in range(batch)]
    groups = [[p] for p in prompts] if batch == 1 else [cycled]
    before, seconds, outputs = _counters(llm), 0.0, []
    for group in groups:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    after = _counters(llm)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "tok_s": sum(len(o) for o in outputs) / seconds,
        "acceptance": accepted / drafted if drafted else 0.0,
        "draft_tokens": drafted,
        "outputs": outputs,
    }


def run(model_dir: Path, workload: dict[str, Any], ngram: tuple[int, int, int] | None) -> dict:
    os.environ.update(ENV)  # read when vllm is imported: set first
    import vllm

    extra = {}
    if ngram is not None:
        k, low, high = ngram
        extra["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": low,
            "prompt_lookup_max": high,
        }
    llm = vllm.LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        disable_log_stats=False,  # the spec decode counters
        seed=0,
        **extra,
    )
    sets, max_tokens, batches = workload["sets"], workload["max_tokens"], workload["batches"]
    for batch in batches:  # warm-up, untimed
        _measure(vllm, llm, sets["grounded"], batch, 16)
    figures: dict[str, Any] = {"version": vllm.__version__, "ngram": ngram}
    for kind, prompts in sets.items():
        for batch in batches:
            figures[f"{kind}_batch{batch}"] = _measure(vllm, llm, prompts, batch, max_tokens)
    figures["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    figures["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint folder")
    parser.add_argument("--workload", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ngram", help="K,MIN,MAX: vLLM's n-gram speculation (default: off)")
    args = parser.parse_args(argv)
    ngram = None if args.ngram is None else tuple(int(x) for x in args.ngram.split(","))
    workload = json.loads(args.workload.read_text(encoding="utf-8"))
    figures = run(args.model_dir, workload, ngram)  # type: ignore[arg-type]
    args.out.write_text(json.dumps(figures) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
