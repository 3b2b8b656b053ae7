"""`kvabi bench tp`: tensor parallelism over processes on this machine, TP = 2 (one thread per
rank) against TP = 1 (both threads in one process), in one run.

The bundled SmolLM2-135M-Instruct, greedy, `max_tokens` new tokens from a short prompt at
batch 1, and 16 prompts at once. For each: output tokens per second, `*_speedup_ratio` (TP 2
over TP 1), how many outputs TP 2 gives token for token as TP 1 (all, in fp32: a test; in
bf16 the partial sums round before the all-reduce adds them, so a near-tie may part), and
rank 0's time per step in the all-reduces
(two per layer) and in broadcasting the step to the worker. On a 2-core CPU the ranks share
the cores the one process would use, so the ratio shows what the collectives cost, not what a
second machine's memory bandwidth would add.
"""

from __future__ import annotations

import time
from typing import Any

from kvabi.abi.table import print_table
from kvabi.bench.decode_bench import _ran_on
from kvabi.bench.report import write_json
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "List ten uses for a paperclip.",
    "Describe the water cycle to a child.",
]
BATCHES = (1, 16)


def _measure(llm: LLM, batch: int, max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    tp = llm.engine.tp
    before = (0.0, 0.0, 0) if tp is None else (tp.reduce_s, tp.send_s, tp.num_steps)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    figures: dict[str, Any] = {"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}
    if tp is not None:
        steps = tp.num_steps - before[2]
        figures["reduce_ms_per_step"] = 1e3 * (tp.reduce_s - before[0]) / steps
        figures["send_ms_per_step"] = 1e3 * (tp.send_s - before[1]) / steps
        figures["ms_per_step"] = 1e3 * seconds / steps
    return figures


def run(quick: bool, json_path: str | None, dtype: str = "auto") -> dict:
    max_tokens = 32 if quick else 128
    figures: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens}
    results: dict[int, dict[int, dict[str, Any]]] = {}
    for size in (1, 2):
        llm = LLM(MODEL, dtype=dtype, progress=False, tensor_parallel_size=size)
        try:
            _measure(llm, 1, 8)  # warm-up: kernels built, allocator grown
            results[size] = {b: _measure(llm, b, max_tokens) for b in BATCHES}
            if size == 1:
                how = "all-reduce through /dev/shm, broadcast over gloo, 1 torch thread per rank"
                figures["ran_on"] = _ran_on(llm) | {"tp2": how}
                figures["dtype"] = str(llm.engine.loaded.model.dtype).removeprefix("torch.")
        finally:
            llm.engine.close()
    for b in BATCHES:
        one, two = results[1][b], results[2][b]
        k = f"batch{b}"
        figures |= {
            f"{k}_tp1_tok_s": one["tok_s"],
            f"{k}_tp2_tok_s": two["tok_s"],
            f"{k}_speedup_ratio": two["tok_s"] / one["tok_s"],
            f"{k}_tp2_ms_per_step": two["ms_per_step"],
            f"{k}_tp2_reduce_ms_per_step": two["reduce_ms_per_step"],
            f"{k}_tp2_send_ms_per_step": two["send_ms_per_step"],
            f"{k}_reduce_share_ratio": two["reduce_ms_per_step"] / two["ms_per_step"],
            f"{k}_identical_outputs": f"{_same(one['tokens'], two['tokens'])}/{b}",
        }
    _print(figures)
    write_json(json_path, figures)
    return figures


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def _print(f: dict[str, Any]) -> None:
    rows = [
        [b, f[f"batch{b}_tp1_tok_s"], f[f"batch{b}_tp2_tok_s"], f[f"batch{b}_speedup_ratio"],
         f[f"batch{b}_tp2_ms_per_step"], f[f"batch{b}_tp2_reduce_ms_per_step"],
         f[f"batch{b}_tp2_send_ms_per_step"], f[f"batch{b}_identical_outputs"]]
        for b in BATCHES
    ]  # fmt: skip
    print_table(
        f"kvabi bench tp: {f['model']} {f['dtype']}, greedy, {f['max_tokens']} tokens",
        ["batch", "TP1 tok/s", "TP2 tok/s", "TP2/TP1", "TP2 ms/step", "all-reduce ms/step",
         "broadcast ms/step", "same tokens"],
        rows,
    )  # fmt: skip
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()))
