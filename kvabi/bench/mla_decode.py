"""Decode tokens/s of one random MLA model: the engine over bf16 `vllm-mla` latents and over
fp8_ds_mla records, against transformers' `generate` (DeepseekV3ForCausalLM, its expanded
DynamicCache) with the same weights, at batch 1 and 16 concurrent requests.

Every run generates `num_new` tokens per request after a `prompt_len`-token prompt, greedy, EOS
ignored; tokens/s = batch * num_new over the run's wall time (prefill included: the same short
prompt for all three). The three take turns, `repeats` rounds, and each one's fastest run
counts (a shared host only ever adds time).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvabi.bench.mla_accuracy import LAYOUTS
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.registry import LoadedModel

BATCHES = (1, 16)


def _engine_seconds(engine: LLMEngine, prompts: list[list[int]], num_new: int) -> float:
    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


@torch.no_grad()
def _hf_seconds(hf: Any, prompts: list[list[int]], num_new: int) -> float:
    ids = torch.tensor(prompts)  # [batch, prompt_len]: equal lengths, no padding
    start = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        pad_token_id=0,
    )
    return time.perf_counter() - start


def decode_rates(loaded: LoadedModel, hf: Any, prompts: list[list[int]], num_new: int,
                 repeats: int) -> dict[str, float]:  # fmt: skip
    """`{batch}_{engine}_tokens_per_s` for engine in bf16, fp8, hf, and kvabi-over-HF ratios."""
    if len(prompts) < max(BATCHES):
        raise ValueError(f"{len(prompts)} prompts for batches up to {max(BATCHES)}")
    hf.generation_config.eos_token_id = None
    runs = {"hf": lambda p, n: _hf_seconds(hf, p, n)}
    for name, layout in LAYOUTS.items():
        # no prefix caching: the repeats reuse the prompts, which HF prefills each time
        config = EngineConfig(
            kv_layout=layout, max_num_seqs=max(BATCHES), enable_prefix_caching=False
        )
        engine = LLMEngine(loaded, config)
        runs[name] = lambda p, n, engine=engine: _engine_seconds(engine, p, n)
    figures: dict[str, float] = {}
    for batch in BATCHES:
        batch_prompts = prompts[:batch]  # distinct prompts
        for run in runs.values():
            run(batch_prompts, 4)  # warm-up: kernels picked, allocator grown
        seconds = {name: float("inf") for name in runs}
        for _ in range(repeats):  # interleaved: a burst of other work hits every engine alike
            for name, run in runs.items():
                seconds[name] = min(seconds[name], run(batch_prompts, num_new))
        for name, s in seconds.items():
            figures[f"batch{batch}_{name}_tokens_per_s"] = batch * num_new / s
        hf_rate = figures[f"batch{batch}_hf_tokens_per_s"]
        for name in LAYOUTS:
            rate = figures[f"batch{batch}_{name}_tokens_per_s"]
            figures[f"batch{batch}_{name}_vs_hf_ratio"] = rate / hf_rate
    return figures
