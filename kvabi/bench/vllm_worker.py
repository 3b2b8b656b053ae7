"""vLLM's side of `kvabi bench throughput`: one run of a token-id workload, figures to JSON.

Standalone: imports only the stdlib and vllm, and runs with vLLM's own interpreter
(`scripts/setup_vllm.sh` makes it), never imported by kvabi:

    .venv-vllm/bin/python kvabi/bench/vllm_worker.py --model-dir DIR --workload W.json \
        --out OUT.json --dtype bfloat16

Workload: {"batch1": {"prompt_ids": [...], "max_tokens": 64},
           "concurrent": [{"prompt_ids": [...], "max_tokens": n}, ...]}.
All generation is greedy with ignore_eos, prompts go in as token ids, prefix caching is off
(batch 1 runs the same prompt twice; a cache hit would shrink the second prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: no __main__ guard games
    "HF_HUB_OFFLINE": "1",  # the model is a local folder; never reach for the hub
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
}
MAX_MODEL_LEN = 2048
DTYPES = ("bfloat16", "float32")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint folder")
    parser.add_argument("--workload", required=True, type=Path, help="workload JSON")
    parser.add_argument("--out", required=True, type=Path, help="where the figures go (JSON)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    return parser.parse_args(argv)


def _check_workload(workload: dict[str, Any]) -> None:
    requests = [workload["batch1"], *workload["concurrent"]]
    for request in requests:
        if not request["prompt_ids"] or request["max_tokens"] < 1:
            raise ValueError(f"workload: empty prompt or max_tokens < 1 in {request!r:.80}")
    if workload["batch1"]["max_tokens"] < 2:
        raise ValueError("workload: batch1 max_tokens must be >= 2 to time decode")
    if not workload["concurrent"]:
        raise ValueError("workload: concurrent is empty")


def _params(vllm: Any, max_tokens: int) -> Any:
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _timed_generate(llm: Any, prompts: list[dict], params: Any) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _batch1(vllm: Any, llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """TTFT = a max_tokens=1 run; decode rate = the other tokens over the extra time they took."""
    prompt = [{"prompt_token_ids": request["prompt_ids"]}]
    max_tokens = request["max_tokens"]
    # the median of 5, as throughput_workers.py measures every other engine
    ttft = statistics.median(_timed_generate(llm, prompt, _params(vllm, 1))[0] for _ in range(5))
    total, outputs = _timed_generate(llm, prompt, _params(vllm, max_tokens))
    tokens = list(outputs[0].outputs[0].token_ids)
    return {
        "batch1_ttft_s": ttft,
        "batch1_total_s": total,
        "batch1_decode_tok_s": (max_tokens - 1) / (total - ttft),
        "batch1_tokens": tokens,
    }


def _concurrent(vllm: Any, llm: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """All requests in one generate call; aggregate rate = generated tokens / wall time."""
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    params = [_params(vllm, r["max_tokens"]) for r in requests]
    wall, outputs = _timed_generate(llm, prompts, params)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "concurrent_tok_s": num_tokens / wall,
        "concurrent_wall_s": wall,
        "concurrent_tokens": num_tokens,
    }


def run(model_dir: Path, workload: dict[str, Any], dtype: str) -> dict[str, Any]:
    os.environ.update(ENV)  # read when vllm is imported: set first
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,  # no graph capture/compile: seconds off startup
        enable_prefix_caching=False,
        seed=0,
    )
    startup = time.perf_counter() - start
    # Warm-up as for every engine in the bench: the whole workload once, untimed.
    _batch1(vllm, llm, workload["batch1"])
    _concurrent(vllm, llm, workload["concurrent"])
    figures = {"engine": "vllm", "version": vllm.__version__, "dtype": dtype, "startup_s": startup}
    # vLLM logs "Reducing Torch threads to 1" in-process but its CPU worker has already
    # disabled torch.set_num_threads: torch keeps its default threads unless OMP_NUM_THREADS
    # is set. Record what decides the thread count, so figures can be compared.
    figures["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    figures["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    figures |= _batch1(vllm, llm, workload["batch1"])
    figures |= _concurrent(vllm, llm, workload["concurrent"])
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    workload = json.loads(args.workload.read_text(encoding="utf-8"))
    _check_workload(workload)
    figures = run(args.model_dir, workload, args.dtype)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in figures.items() if k != "batch1_tokens"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
