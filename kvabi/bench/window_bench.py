"""`kvabi bench windows`: KV bytes a hybrid model's block groups hold, against a cache that keeps
every token in every layer (what an engine without block groups allocates for the same model:
vLLM with `--disable-hybrid-kv-cache-manager`, HF's DynamicCache before sliding layers).

The model (default `gemma3-270m`: 18 layers, 15 of them sliding over 512 tokens) runs a few
long prompts of random words, all submitted at once, greedy, through the engine. After every
step it sums, over the running requests, the bytes of the blocks their tables hold (a block
counted once, whichever group or request holds it), and the bytes the same tokens would take
in every KV-owning layer. Figures: the peak of each and their ratio, and the ratio summed over
all steps (`*_ratio`: windowless over held, so above 1 is what the windows save).
"""

from __future__ import annotations

import random
import time
from typing import Any

from kvabi.abi.table import print_table
from kvabi.bench.decode_bench import _ran_on
from kvabi.bench.report import write_json
from kvabi.bench.throughput import WORDS
from kvabi.engine.engine import LLMEngine
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams

MODEL = "gemma3-270m"
QUICK = (4, 2048, 16)  # requests, prompt tokens, output tokens
FULL = (4, 8192, 64)


def run(
    quick: bool,
    json_path: str | None,
    model: str | None = None,
    sizes: tuple[int, int, int] | None = None,
    llm: LLM | None = None,
) -> dict[str, Any]:
    """`sizes`: (requests, prompt tokens, output tokens), else QUICK or FULL; `llm`: an engine
    already started on `model` (else one is started)."""
    num_requests, prompt_len, out_len = sizes or (QUICK if quick else FULL)
    llm = llm or start(model or MODEL)
    engine = llm.engine
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(3 * prompt_len))
    corpus = engine.tokenizer.encode(text, add_special_tokens=False)[:prompt_len]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request([corpus[i]] + corpus[1:], params)  # no prefix shared between them
    held_sum = full_sum = held_peak = full_peak = steps = 0
    sizes = _block_bytes(engine)
    began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        held, full = _held_bytes(engine, sizes), _windowless_bytes(engine, sizes)
        held_sum, full_sum, steps = held_sum + held, full_sum + full, steps + 1
        held_peak, full_peak = max(held_peak, held), max(full_peak, full)
    figures = {
        "model": model or MODEL,
        "requests": num_requests,
        "prompt_tokens": prompt_len,
        "output_tokens": out_len,
        "steps": steps,
        "seconds": time.perf_counter() - began,
        "groups": [[len(g.layer_ids), g.window] for g in engine.cache.groups],
        "held_peak_bytes": held_peak,
        "windowless_peak_bytes": full_peak,
        "peak_windowless_vs_held_ratio": full_peak / held_peak,
        "windowless_vs_held_ratio": full_sum / held_sum,
        "ran_on": _ran_on(llm),
    }
    _print(figures)
    write_json(json_path, figures)
    return figures


def start(model: str) -> LLM:
    return LLM(model, progress=False, max_num_batched_tokens=1024)


def has_windows(llm: LLM) -> bool:
    """Whether the engine's cache has sliding-window groups (what this bench measures)."""
    return any(g.window for g in llm.engine.cache.groups)  # 0: full attention


def _block_bytes(engine: LLMEngine) -> list[int]:
    """Bytes of one block of each pool (every layer slot's K and V)."""
    return [
        sum(t[0].numel() * t.element_size() for t in (*s.k, *s.v)) for s in engine.cache.storages
    ]


def _held_bytes(engine: LLMEngine, sizes: list[int]) -> int:
    blocks = {
        (g.pool_id, b)
        for s in engine.scheduler.running
        for g, table in zip(engine.cache.groups, s.block_tables, strict=True)
        for b in table
        if b >= 0
    }
    return sum(sizes[p] for p, _ in blocks)


def _windowless_bytes(engine: LLMEngine, sizes: list[int]) -> int:
    """The running requests' computed tokens in every KV-owning layer, in whole blocks."""
    storages = engine.cache.storages
    per_block = sum(
        len(g.layer_ids) * sizes[g.pool_id] // len(storages[g.pool_id].k)
        for g in engine.cache.groups
    )  # one block of every owning layer
    bs = engine.config.block_size
    return sum(-(-s.num_computed // bs) * per_block for s in engine.scheduler.running)


def _print(f: dict[str, Any]) -> None:
    print_table(
        f"KV held by block groups vs every token in every layer: {f['model']}, "
        f"{f['requests']} requests of {f['prompt_tokens']} + {f['output_tokens']} tokens, "
        f"groups (layers, window) {f['groups']}",
        ["measure", "held (groups)", "windowless", "windowless / held"],
        [
            ["peak bytes", f["held_peak_bytes"], f["windowless_peak_bytes"],
             f["peak_windowless_vs_held_ratio"]],
            ["all steps", "", "", f["windowless_vs_held_ratio"]],
        ],
    )  # fmt: skip
    print(f"ran on: {f['ran_on']}")
