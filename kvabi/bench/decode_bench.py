"""`kvabi bench decode`: time per output token late in a long output against early in it.

One engine on the bundled SmolLM2-135M (bf16), greedy, EOS ignored, a short prompt; at batch 1
and at batch 16 every request asks 2,048 tokens (`--quick`: 512), all in step. Each step is
timed and split into the model's forward (`ModelRunner.run`) and the rest (scheduling,
sampling, stop rules, detokenizing, outputs). A step gives each request one token, so its time
is the time per output token; figures are the fastest step among the first 256 tokens after
the first one and among the last 256 (`--quick`: 64): on a shared host other work only ever
adds time, so the fastest is the step's own cost (as `best_seconds`). An
`outside_forward_late_vs_early_ratio` near 1 says the engine's own cost per token does not grow
with the output; `late_vs_early_ratio` also holds attention, which reads the whole context and
so grows by design.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvabi.abi.table import print_table
from kvabi.bench.report import machine, write_json
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from kvabi.native.cpu_kernels import cpu_kernels, kernel_status

PROMPT = "Once upon a time, in a small town by the sea,"
BATCHES = (1, 16)
PARTS = {"whole step": "", "outside forward": "outside_forward_"}  # row -> figure name prefix
Step = tuple[float, float]  # seconds of one engine step, and of the forward in it


class _ForwardTimer:
    """Wraps `ModelRunner.run`, adding up the seconds spent in it."""

    def __init__(self, run: Callable[..., Any]) -> None:
        self.seconds, self._run = 0.0, run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._run(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _steps(llm: LLM, timer: _ForwardTimer, batch: int, num_tokens: int) -> list[Step]:
    """Run `batch` requests of `num_tokens` tokens each; every step's times."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for _ in range(batch):
        llm.engine.add_request(PROMPT, params)
    steps = []
    while llm.engine.has_unfinished():
        start, forward = time.perf_counter(), timer.seconds
        llm.engine.step()
        steps.append((time.perf_counter() - start, timer.seconds - forward))
    if len(steps) != num_tokens:  # one prefill step, then one token per step for all
        raise RuntimeError(f"{len(steps)} steps for {num_tokens} tokens: not in step")
    return steps


def _figures(steps: list[Step], window: int) -> dict[str, float]:
    """Fastest ms per token early and late (the first step, the prompt's, left out)."""
    out = {}
    for prefix in PARTS.values():
        ms = [1e3 * (total - forward if prefix else total) for total, forward in steps]
        early, late = min(ms[1 : window + 1]), min(ms[-window:])
        out |= {f"{prefix}early_ms": early, f"{prefix}late_ms": late}
        out[f"{prefix}late_vs_early_ratio"] = late / early
    return out


def _ran_on(llm: LLM) -> dict[str, Any]:
    """Which CPU and kernel path the figures come from."""
    kernels = cpu_kernels()
    return machine() | {
        "kernels": kernel_status(),
        "amx": bool(kernels is not None and kernels.amx),
        "gemm": (kernels.gemm if kernels is not None else None) or "oneDNN (torch)",
        "attention_backend": llm.engine.config.attention_backend,
        "fused_decode": llm.engine.runner.fused is not None,
    }


def run(quick: bool, json_path: str | None) -> dict:
    num_tokens, window = (512, 64) if quick else (2048, 256)
    blocks = max(BATCHES) * (num_tokens + 64) // 16 + 16
    llm = LLM(dtype="bf16", progress=False, num_blocks=blocks, enable_prefix_caching=False)
    timer = _ForwardTimer(llm.engine.runner.run)
    llm.engine.runner.run = timer
    for batch in BATCHES:  # warm-up: kernels built, allocator grown
        _steps(llm, timer, batch, 32)
    figures: dict[str, Any] = {
        "num_tokens": num_tokens,
        "window": window,
        "prompt_tokens": len(llm.tokenizer.encode(PROMPT)),
        "ran_on": _ran_on(llm),
    }
    for batch in BATCHES:
        for key, value in _figures(_steps(llm, timer, batch, num_tokens), window).items():
            figures[f"batch{batch}_{key}"] = value
    _print(figures)
    write_json(json_path, figures)
    return figures


def _print(f: dict[str, Any]) -> None:
    n, w = f["num_tokens"], f["window"]
    rows = []
    for batch in BATCHES:
        for part, prefix in PARTS.items():
            k = f"batch{batch}_{prefix}"
            rows.append(
                [batch, part, f[f"{k}early_ms"], f[f"{k}late_ms"], f[f"{k}late_vs_early_ratio"]]
            )
    print_table(
        f"kvabi bench decode: SmolLM2-135M bf16, {f['prompt_tokens']}-token prompt + {n} tokens "
        f"per request; ms per output token (fastest step), tokens 1-{w} vs the last {w}",
        ["batch", "part", "early ms", "late ms", "late/early"],
        rows,
    )
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()))
