"""fp8_ds_mla against bf16 latents, teacher-forced through the paged engine.

One engine per cache layout over the same loaded model (bf16 weights): `vllm-mla` (bf16
[c_kv | k_pe]) and `vllm-fp8-ds-mla` (vLLM's 656-byte records). The bf16 engine decodes each
prompt greedily; the fp8 engine then decodes the same prompt with its tokens forced to the bf16
run's, so its step t has seen exactly the bf16 run's tokens before t (over its own fp8 cache),
and the two steps' full-vocabulary logits compare like for like.

Logits are read by wrapping `ModelRunner.run`, the engine's one call that returns them (as
`kvabi bench decode` wraps it for timing); forcing returns, in their place, logits whose argmax
is the forced token, which greedy sampling then appends. The engine itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.registry import LoadedModel

LAYOUTS = {"bf16": "vllm-mla", "fp8": "vllm-fp8-ds-mla"}


class _LogitsTap:
    """Wraps `ModelRunner.run` while one request runs alone: keeps each step's logits row
    ([vocab] float32); with `forced` tokens, steers greedy sampling to them."""

    def __init__(self, run: Callable[..., torch.Tensor]) -> None:
        self._run = run
        self.rows: list[torch.Tensor] = []
        self.forced: list[int] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self._run(*args, **kwargs)  # [num sampling seqs (0 or 1), vocab]
        if logits.shape[0] == 0:
            return logits
        self.rows.append(logits[0].clone())
        if self.forced is None:
            return logits
        steered = torch.zeros_like(logits)
        steered[0, self.forced[len(self.rows) - 1]] = 1.0
        return steered


def _tapped_engine(loaded: LoadedModel, layout: str) -> tuple[LLMEngine, _LogitsTap]:
    engine = LLMEngine(loaded, EngineConfig(kv_layout=layout, enable_prefix_caching=False))
    tap = _LogitsTap(engine.runner.run)
    engine.runner.run = tap
    return engine, tap


def _decode(engine: LLMEngine, tap: _LogitsTap, prompt: list[int], forced: list[int] | None,
            num_steps: int) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """One request alone: its tokens and each step's logits [num_steps, vocab]."""
    tap.rows, tap.forced = [], forced
    engine.add_request(prompt, SamplingParams(max_tokens=num_steps, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    return tokens, torch.stack(tap.rows)


def teacher_forced(loaded: LoadedModel, prompts: list[list[int]], num_steps: int) -> dict:
    """Top-1 agreement and |delta logit| of the fp8 cache's steps against the bf16 cache's."""
    bf16, fp8 = (_tapped_engine(loaded, LAYOUTS[k]) for k in ("bf16", "fp8"))
    agree, deltas, want_rows = [], [], []
    for prompt in prompts:
        tokens, want = _decode(*bf16, prompt, None, num_steps)
        forced, got = _decode(*fp8, prompt, tokens, num_steps)
        if forced != tokens or len(tokens) != num_steps:
            raise RuntimeError("teacher forcing did not hold the fp8 run to the bf16 tokens")
        agree.append(got.argmax(-1) == torch.tensor(tokens))
        deltas.append((got - want).abs())
        want_rows.append(want)
    delta, want = torch.cat(deltas), torch.cat(want_rows)
    top2 = want.topk(2, dim=-1).values
    return {
        "num_prompts": len(prompts),
        "num_steps": num_steps,
        "fp8_top1_agreement_ratio": float(torch.cat(agree).float().mean()),
        "max_abs_dlogit": float(delta.max()),
        "mean_abs_dlogit": float(delta.mean()),
        "bf16_logit_std": float(want.std()),
        "bf16_min_top2_margin": float((top2[:, 0] - top2[:, 1]).min()),
    }
