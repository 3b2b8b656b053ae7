"""`kvabi bench compress`: what compressed KV costs in quality and saves in memory.

1. Presses (kvabi/engine/press.py) on SmolLM2-135M-Instruct's real weights, StreamingLLM and
   SnapKV at 2x, 4x and 8x (ratios 0.5, 0.75, 0.875) beside no press, in one run:
   - needle in a haystack: seeded haystacks of 1k-4k tokens (random words), a 5-digit
     passcode sentence at a random depth, then the question; retrieval accuracy = the greedy
     answer contains the passcode. Twice: the question after the pressed context (kvpress's
     pipeline: the press cannot know it), and inside it (SnapKV's setting: its window holds
     the question), the chat template's assistant header after the press either way;
   - teacher-forced top-1 agreement on a held text (docs/ARCHITECTURE.md): the first
     `context` tokens pressed, then for each of the next `steps` positions the top-1 token
     after the text up to it (one request per position), compared with no press.
2. Memory, from the descriptors (kvabi/abi/plan.py): DeepSeek-V4-Flash's cache (catalog) per
   layer type and at 1M tokens, against a dense MLA cache of the same model (every token's
   512-value K=V row in every layer, `vllm-mla`) and against DeepSeek-V3's; and the share of a
   context each press keeps.

A PNG plots quality against compression.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from kvabi.abi.catalog import catalog_model
from kvabi.abi.descriptor import ATTN, MLA, LayerSpec, ModelSpec
from kvabi.abi.plan import group_memory, plan
from kvabi.abi.presets import preset_descriptor
from kvabi.bench.compress_report import plot, print_figures
from kvabi.bench.decode_bench import _ran_on
from kvabi.bench.report import write_json
from kvabi.bench.throughput import WORDS
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.press import n_kept
from kvabi.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
PRESSES = [(None, 0.0)] + [(m, r) for m in ("streaming", "snapkv") for r in (0.5, 0.75, 0.875)]
QUESTION = "What is the secret passcode? Answer with the number only."
HELD_TEXT = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"
DEFAULT_PLOT = "out/bench/compress_quality.png"
MILLION = 1 << 20


@dataclass(frozen=True)
class Sizes:
    haystacks: int
    min_tokens: int
    max_tokens: int
    held_context: int
    held_steps: int


QUICK = Sizes(8, 1024, 2048, 768, 8)
FULL = Sizes(50, 1024, 4096, 1536, 32)


def run(quick: bool, json_path: str | None, plot_path: str | None = DEFAULT_PLOT) -> dict:
    from kvabi.models.registry import load_model

    sizes = QUICK if quick else FULL
    loaded = load_model(MODEL, dtype="auto", progress=False)
    config = EngineConfig(max_num_batched_tokens=sizes.max_tokens + 64, block_size=16)
    engine = LLMEngine(loaded, config)
    start = time.perf_counter()
    figures: dict = {"model": MODEL, "dtype": str(loaded.model.dtype).removeprefix("torch.")}
    figures |= niah(engine, sizes) | agreement(engine, sizes)
    figures["quality_seconds"] = time.perf_counter() - start
    figures |= memory()
    figures["ran_on"] = _ran_on(SimpleNamespace(engine=engine))  # it reads `.engine`
    if plot_path:
        plot(figures, plot_path)
        figures["plot"] = plot_path
    print_figures(figures)
    write_json(json_path, figures)
    return figures


def name(method: str | None, ratio: float) -> str:
    return "full" if method is None else f"{method}_{round(1 / (1 - ratio))}x"


def press_spec(method: str | None, ratio: float, question: int) -> str | None:
    return None if method is None else f"{method}:ratio={ratio},question={question}"


def haystack(
    rng: random.Random, num_tokens: int, engine: LLMEngine, aware: bool
) -> tuple[list[int], int, str]:
    """A chat prompt of `num_tokens` or a few more: random-word sentences with the needle at a
    random depth, then the question. Returns its ids, how many of its last tokens come after
    the press (the question and the template's tail; `aware`: the tail only, so the question
    is in the pressed context, SnapKV's own setting) and the passcode."""
    code = str(rng.randrange(10000, 100000))
    tokenizer, sentences = engine.tokenizer, []
    while len(tokenizer.encode(" ".join(sentences))) < num_tokens:
        for _ in range(20):
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
            sentences.append(" ".join(words).capitalize() + ".")
    sentences.insert(rng.randint(0, len(sentences)), f"The secret passcode is {code}.")
    text = " ".join(sentences) + "\n\n" + QUESTION
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], True)
    after = ("" if aware else "\n\n" + QUESTION) + "<|im_end|>\n<|im_start|>assistant\n"
    tail = tokenizer.encode(after)
    if ids[-len(tail) :] != tail:
        raise RuntimeError("the question did not tokenize alike inside the chat template")
    return ids, len(tail), code


def greedy(engine: LLMEngine, ids: list[int], press: str | None, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, press=press)
    rid, tokens = engine.add_request(ids, params), []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.outputs[0].token_ids
    return tokens


def niah(engine: LLMEngine, sizes: Sizes) -> dict:
    """Retrieval accuracy per press, the question after the press (kvpress's pipeline:
    `niah_*`) and inside the pressed context (SnapKV's setting: `niah_aware_*`)."""
    out: dict = {}
    for prefix, aware in (("niah", False), ("niah_aware", True)):
        rng = random.Random(0)  # the same haystacks for both
        lengths = [rng.randint(sizes.min_tokens, sizes.max_tokens) for _ in range(sizes.haystacks)]
        cases = [haystack(rng, n, engine, aware) for n in lengths]
        out[f"{prefix}_haystacks"] = len(cases)
        out[f"{prefix}_mean_tokens"] = sum(len(c[0]) for c in cases) / len(cases)
        for method, ratio in PRESSES:
            hits = 0
            for ids, after, code in cases:
                tokens = greedy(engine, ids, press_spec(method, ratio, after), 12)
                hits += code in engine.tokenizer.decode(tokens)
            out[f"{prefix}_{name(method, ratio)}_accuracy"] = hits / len(cases)
        full = out[f"{prefix}_full_accuracy"]
        for method, ratio in PRESSES[1:]:
            key = f"{prefix}_{name(method, ratio)}"
            out[f"{key}_vs_full_ratio"] = out[f"{key}_accuracy"] / full if full else 0.0
    return out


def agreement(engine: LLMEngine, sizes: Sizes) -> dict:
    """Teacher-forced top-1 agreement with no press over `held_steps` positions."""
    ids = engine.tokenizer.encode(HELD_TEXT.read_text())
    context, steps = sizes.held_context, sizes.held_steps
    top1 = {}
    for method, ratio in PRESSES:
        top1[name(method, ratio)] = [
            greedy(engine, ids[: context + i], press_spec(method, ratio, i), 1)[0]
            for i in range(steps)
        ]
    truth = ids[context : context + steps]
    out: dict = {
        "agree_context_tokens": context,
        "agree_steps": steps,
        "agree_full_vs_text": sum(a == b for a, b in zip(top1["full"], truth, strict=True)) / steps,
    }
    for method, ratio in PRESSES[1:]:
        key = name(method, ratio)
        same = sum(a == b for a, b in zip(top1[key], top1["full"], strict=True))
        out[f"agree_{key}_top1_ratio"] = same / steps
    return out


def memory() -> dict:
    """Bytes from the descriptors (bf16): DeepSeek-V4-Flash's compressed cache against its
    uncompressed K=V rows and DeepSeek-V3's MLA; the presses' KV per request."""
    v4 = preset_descriptor("kvabi-compressed", catalog_model("deepseek-v4-flash"))
    layers = v4.model.layers
    num_layers = sum(1 for x in layers if x.kind == ATTN)
    # the same model uncompressed: every token's 512-value K=V row (448 + 64 RoPE) per layer
    row = LayerSpec(MLA, latent_dim=448, rope_dim=64)
    dense = preset_descriptor("vllm-mla", ModelSpec((row,) * num_layers, "v4-dense"))
    v3 = preset_descriptor("vllm-mla", catalog_model("deepseek-v3"))
    out: dict = {}
    for g in group_memory(v4, MILLION):
        kind = "window" if g.group.spec.kind == ATTN else f"entries_1_{g.group.spec.ratio}"
        per_layer = g.bytes_per_request / len(g.group.layer_ids)
        out[f"v4_{kind}_layers"] = len(g.group.layer_ids)
        out[f"v4_{kind}_bytes_per_layer_1m"] = per_layer
        out[f"v4_{kind}_bytes_per_token_per_layer"] = per_layer / MILLION
    v4_bytes = plan(v4, MILLION).bytes_per_request
    kv_rows = plan(dense, MILLION).bytes_per_request
    out |= {
        "v4_bytes_1m": v4_bytes,
        "v4_uncompressed_bytes_1m": kv_rows,
        "v3_mla_bytes_1m": plan(v3, MILLION).bytes_per_request,
        "v4_vs_uncompressed_ratio": v4_bytes / kv_rows,
        "v4_vs_v3_mla_ratio": v4_bytes / plan(v3, MILLION).bytes_per_request,
    }
    for method, ratio in PRESSES[1:]:  # kvpress's rule: a 4096-token context keeps n_kept
        out[f"press_{name(method, ratio)}_kept_ratio"] = n_kept(4096, ratio) / 4096
    return out
