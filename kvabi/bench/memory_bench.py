"""`kvabi bench memory`: KV memory holding live tokens over KV memory reserved, paged vs contiguous.

One seeded mix of requests (prompt and output lengths drawn uniformly, outputs to their full
length) runs through the engine with the bundled model, all submitted at once. After every step
it measures, over the running requests:
- live: tokens whose K/V is in the cache;
- paged: the blocks they hold (the engine's actual reservation; a block shared by two
  requests counts once);
- contiguous at the context window: one region of `max_model_len` tokens per request (a
  static per-request cache, e.g. HF's `StaticCache`);
- contiguous at the request's own maximum: `prompt + max_tokens` tokens per request, the best a
  contiguous reservation can do, and only when the output length is known in advance.
Utilisation = sum of live over sum of reserved, across all steps. Target: at least 90% paged.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvabi.abi.table import print_table
from kvabi.bench.report import write_json
from kvabi.bench.throughput import WORDS
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Mix:
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    max_num_seqs: int = 16


QUICK = Mix(16, (16, 256), (8, 48))
FULL = Mix(48, (16, 768), (16, 256))


@dataclass
class Tally:
    live: int = 0
    paged: int = 0
    contiguous_window: int = 0
    contiguous_request: int = 0
    steps: int = 0
    peak_paged: int = 0

    def add(self, engine: LLMEngine, max_tokens: dict[str, int]) -> None:
        running = engine.scheduler.running
        blocks = {b for s in running for b in s.block_ids}
        paged = len(blocks) * engine.config.block_size
        self.live += _live_tokens(running, engine.config.block_size)
        self.paged += paged
        self.contiguous_window += len(running) * engine.info.max_model_len
        self.contiguous_request += sum(
            len(s.prompt_ids) + max_tokens[s.request_id] for s in running
        )
        self.steps += 1
        self.peak_paged = max(self.peak_paged, paged)


def _live_tokens(running: list, block_size: int) -> int:
    """Tokens with K/V in the cache; a block shared by several requests counts once."""
    filled: dict[int, int] = {}
    for s in running:
        for i, b in enumerate(s.block_ids):
            filled[b] = max(filled.get(b, 0), min(block_size, s.num_computed - i * block_size))
    return sum(max(n, 0) for n in filled.values())


def run(quick: bool, json_path: str | None, model: str | None = None) -> dict:
    """`model`: default the bundled SmolLM2. A model with sliding-window layers (e.g.
    `gemma3-270m`) is measured by `kvabi bench windows` instead (its block groups hold each
    window's blocks only; paged against contiguous would count one group's table)."""
    from kvabi.models.registry import load_model

    if model is not None:
        from kvabi.bench import window_bench

        llm = window_bench.start(model)
        if window_bench.has_windows(llm):
            print(f"{model} has sliding-window layers: KV held by its block groups against "
                  "every token in every layer (kvabi bench windows)")  # fmt: skip
            return window_bench.run(quick, json_path, model, llm=llm)
        llm.engine.close()
    mix = QUICK if quick else FULL
    loaded = load_model(model, dtype="bf16", progress=False)
    engine = LLMEngine(
        loaded, EngineConfig(max_num_seqs=mix.max_num_seqs, max_num_batched_tokens=1024), "bench"
    )
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(20000))
    corpus = loaded.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = {}
    for _ in range(mix.num_requests):
        n = rng.randint(*mix.prompt_range)
        start = rng.randrange(len(corpus) - n)
        out = rng.randint(*mix.output_range)
        params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
        max_tokens[engine.add_request(corpus[start : start + n], params)] = out
    tally, began = Tally(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        tally.add(engine, max_tokens)
    figures = _figures(tally, engine, mix, time.perf_counter() - began)
    _print(figures)
    write_json(json_path, figures)
    return figures


def _figures(t: Tally, engine: LLMEngine, mix: Mix, seconds: float) -> dict:
    per_token = engine.cache.block_bytes // engine.cache.block_size
    return {
        "requests": mix.num_requests,
        "steps": t.steps,
        "seconds": seconds,
        "block_size": engine.config.block_size,
        "max_model_len": engine.info.max_model_len,
        "kv_bytes_per_token": per_token,
        "peak_paged_bytes": t.peak_paged * per_token,
        "paged_utilisation_ratio": t.live / t.paged,
        "contiguous_window_utilisation_ratio": t.live / t.contiguous_window,
        "contiguous_request_utilisation_ratio": t.live / t.contiguous_request,
        "paged_vs_contiguous_window_ratio": t.contiguous_window / t.paged,
        "paged_vs_contiguous_request_ratio": t.contiguous_request / t.paged,
    }


def _print(f: dict) -> None:
    print_table(
        f"KV memory: {f['requests']} requests, {f['steps']} steps, block size {f['block_size']}, "
        f"{f['kv_bytes_per_token']} B/token",
        ["reservation", "live / reserved", "reserved / paged"],
        [
            ["paged blocks (kvabi)", f["paged_utilisation_ratio"], 1.0],
            [
                f"contiguous at max_model_len ({f['max_model_len']})",
                f["contiguous_window_utilisation_ratio"],
                f["paged_vs_contiguous_window_ratio"],
            ],
            [
                "contiguous at prompt + max_tokens",
                f["contiguous_request_utilisation_ratio"],
                f["paged_vs_contiguous_request_ratio"],
            ],
        ],
    )
