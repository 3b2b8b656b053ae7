"""`kvabi bench prefix`: the prefix cache and its tiers on seeded workloads, bundled model.

1. TTFT: a 1k-token cached prefix + a 32-token suffix, against the same request after the pool
   forgot the prefix (same engine, `reset_prefix_cache`): the ratio (target >= 4x).
2. RAG (`prefix_workload.rag_trace`), one request at a time: hit rate beside an infinite cache's
   on the same trace (the ceiling), prefill tokens saved, wall time with and without the cache.
3. Chat: sessions of several turns with think time, so they interleave, in a pool too small for
   all of them: hit rate with the pool alone and with a host tier (idle sessions demoted), vs
   the ceiling.
4. Resume: a 2k-token conversation continued from host RAM, and from disk after an engine
   restart (warm start), against re-prefilling it (the same tokens under a fresh cache salt).
5. Capacity: the RAG trace replayed through the engine's own scheduler and pool (no model) for
   pool sizes up to where the ceiling is reached: a PNG of hit rate against capacity.
6. Compressed KV: the RAG trace replayed with DeepSeek-V4-Flash's cache groups (windows,
   CSA and HCA entries) and blocks of 128: hits are whole blocks, so the rate beside the
   whole-block ceiling and the token-granular one.

`--model` picks a bundled model (default SmolLM2-135M), weights in dtype `auto`. A hybrid model
(Gemma 3 270M: 15 sliding + 3 full layers) has several block groups over one pool, each taking
a block per 16 tokens: pool sizes are given per group and multiplied by the number of groups, so
every model's pool holds the same tokens per group; its tier entries are per group too.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass

from kvabi.abi.catalog import catalog_model
from kvabi.bench.prefix_report import plot, print_figures
from kvabi.bench.prefix_workload import (
    ChatTurn,
    RagShape,
    capacity_curve,
    ceiling_hit_tokens,
    chat_schedule,
    corpus_slicer,
    num_block_groups,
    rag_trace,
    replay_hit_rate,
    smallest_pool,
)
from kvabi.bench.report import write_json
from kvabi.bench.throughput import WORDS
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.registry import DEFAULT_MODEL, LoadedModel

BLOCK_SIZE = 16
V4_BLOCK = 128  # DeepSeek V4: a multiple of its ratios 4 and 128
DEFAULT_PLOT = "out/bench/prefix_hit_rate.png"


@dataclass(frozen=True)
class Sizes:
    repeats: int
    rag: RagShape
    rag_pool_blocks: int  # per block group, like chat_pool_blocks
    chat_sessions: int
    chat_turns: int
    chat_pool_blocks: int
    chat_answer_len: int
    chat_user_len: int = 48
    chat_think_s: float = 4.0
    resume_tokens: int = 2048
    ttft_prefix: int = 1024
    ttft_suffix: int = 32


QUICK = Sizes(1, RagShape(12, 16, 96), 40, 5, 3, 24, 6)
FULL = Sizes(3, RagShape(64, 48, 160), 192, 10, 5, 96, 16)


def run(
    quick: bool,
    json_path: str | None,
    plot_path: str | None = DEFAULT_PLOT,
    model: str | None = None,
    sizes: Sizes | None = None,
) -> dict:
    """`sizes`: else QUICK or FULL."""
    from kvabi.interop.model_spec import gguf_fingerprint
    from kvabi.models.registry import load_model, resolve_model

    model = model or DEFAULT_MODEL
    loaded = load_model(model, dtype="auto", progress=False)
    bench = _Bench(loaded, gguf_fingerprint(resolve_model(model).path), sizes or _sizes(quick))
    figures = {"model": model, "dtype": str(loaded.model.dtype).removeprefix("torch.")}
    figures |= {"block_groups": bench.num_groups}
    figures |= bench.ttft() | bench.rag() | bench.chat() | bench.resume()
    figures |= bench.capacity(plot_path) | bench.compressed()
    print_figures(figures)
    write_json(json_path, figures)
    return figures


def _sizes(quick: bool) -> Sizes:
    return QUICK if quick else FULL


class _Bench:
    def __init__(self, loaded: LoadedModel, fingerprint: str, sizes: Sizes) -> None:
        self.loaded, self.fingerprint, self.sizes = loaded, fingerprint, sizes
        self.layers = loaded.config.kv_layers()
        self.num_groups = num_block_groups(self.layers)
        rng = random.Random(0)
        text = " ".join(rng.choice(WORDS) for _ in range(20000))
        self.corpus = loaded.tokenizer.encode(text, add_special_tokens=False)
        self.take = corpus_slicer(self.corpus, random.Random(1))
        self.rag_trace: list[list[int]] = []
        self.rag_hit_rate = 0.0

    def engine(self, blocks_per_group: int, **config: object) -> LLMEngine:
        config = {"max_num_batched_tokens": 4096, "block_size": BLOCK_SIZE} | config
        num_blocks = blocks_per_group * self.num_groups
        return LLMEngine(
            self.loaded, EngineConfig(num_blocks=num_blocks, **config), self.fingerprint
        )

    def ttft(self) -> dict:
        s = self.sizes
        engine = self.engine(512)
        prefix = self.take(s.ttft_prefix)
        _ttft(engine, prefix + self.take(s.ttft_suffix))  # fills the cache, warms up
        cached = min(_ttft(engine, prefix + self.take(s.ttft_suffix)) for _ in range(s.repeats + 2))
        uncached = []
        for _ in range(s.repeats + 1):
            engine.reset_prefix_cache()
            uncached.append(_ttft(engine, prefix + self.take(s.ttft_suffix)))
        return {
            "ttft_prefix_tokens": s.ttft_prefix,
            "ttft_suffix_tokens": s.ttft_suffix,
            "ttft_cached_s": cached,
            "ttft_uncached_s": min(uncached),
            "ttft_ratio": min(uncached) / cached,
        }

    def rag(self) -> dict:
        s = self.sizes
        self.rag_trace = trace = rag_trace(self.corpus, s.rag, seed=2)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, tag="rag")
        cached = self.engine(s.rag_pool_blocks)
        uncached = self.engine(s.rag_pool_blocks, enable_prefix_caching=False)
        cached_s, uncached_s = _run_alternating(cached, uncached, trace, params)
        stats = cached.cache_stats()
        ceiling, queried = ceiling_hit_tokens(trace, BLOCK_SIZE)
        self.rag_hit_rate = hit_rate = stats["tag_rag_hit_rate"]
        pool = s.rag_pool_blocks * self.num_groups
        return {
            "rag_requests": len(trace),
            "rag_prompt_tokens": stats["tag_rag_query_tokens"],
            "rag_pool_blocks": pool,
            "rag_pool_tokens_per_group": s.rag_pool_blocks * BLOCK_SIZE,
            "rag_hit_rate": hit_rate,
            "rag_ceiling_hit_rate": ceiling / queried,
            "rag_hit_vs_ceiling_ratio": hit_rate * queried / ceiling if ceiling else 0.0,
            "rag_replay_hit_rate": replay_hit_rate(trace, pool, BLOCK_SIZE, 2, self.layers),
            "rag_prefill_tokens_saved": stats["tag_rag_saved_tokens"],
            "rag_cached_s": cached_s,
            "rag_uncached_s": uncached_s,
            "rag_speedup_ratio": uncached_s / cached_s,
        }

    def chat(self) -> dict:
        s = self.sizes
        schedule = chat_schedule(s.chat_sessions, s.chat_turns, s.chat_think_s, seed=3)
        system = self.take(64)
        user = {(t.session, t.turn): self.take(s.chat_user_len) for t in schedule}
        out: dict = {
            "chat_turns": len(schedule),
            "chat_pool_blocks": s.chat_pool_blocks * self.num_groups,
        }
        runs = [("pool", TierConfig()), ("host", TierConfig(host_bytes=2**30))]
        for name, tiers in runs:
            engine = self.engine(s.chat_pool_blocks, tiers=tiers)
            prompts = _chat(engine, schedule, system, user, s.chat_answer_len)
            stats = engine.cache_stats()
            engine.close()
            out[f"chat_{name}_hit_rate"] = stats["tag_chat_hit_rate"]
        ceiling, queried = ceiling_hit_tokens(prompts, BLOCK_SIZE)
        out["chat_ceiling_hit_rate"] = ceiling / queried
        out["chat_pool_vs_ceiling_ratio"] = out["chat_pool_hit_rate"] / out["chat_ceiling_hit_rate"]
        out["chat_host_loaded_tokens"] = stats["tier_host_hit_tokens"]
        out["chat_host_vs_ceiling_ratio"] = out["chat_host_hit_rate"] / out["chat_ceiling_hit_rate"]
        return out

    def resume(self) -> dict:
        s = self.sizes
        conversation = self.take(s.resume_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            tiers = TierConfig(host_bytes=2**30, disk_dir=tmp)
            engine = self.engine(2 * s.resume_tokens // BLOCK_SIZE, tiers=tiers)
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, session="c")
            turn = conversation + _generate(engine, conversation, params) + self.take(32)
            engine.flush_tiers()  # the idle session's blocks are in host RAM and on disk
            host = _resumed(engine, turn, s.repeats)
            host_hits = engine.cache_stats()["tier_host_hit_tokens"]
            engine.close()
            restarted = self.engine(
                2 * s.resume_tokens // BLOCK_SIZE, tiers=TierConfig(disk_dir=tmp)
            )
            disk = _resumed(restarted, turn, s.repeats)
            disk_hits = restarted.cache_stats()["tier_disk_hit_tokens"]
            prefill = min(_ttft(restarted, turn, f"cold-{i}") for i in range(s.repeats))
            restarted.close()
        return {
            "resume_tokens": len(turn),
            "resume_prefill_s": prefill,
            "resume_host_s": host,
            "resume_disk_s": disk,
            "resume_host_hit_tokens": host_hits / s.repeats,
            "resume_disk_hit_tokens": disk_hits / s.repeats,
            "resume_host_ratio": prefill / host,
            "resume_disk_ratio": prefill / disk,
        }

    def capacity(self, plot_path: str | None) -> dict:
        ceiling, queried = ceiling_hit_tokens(self.rag_trace, BLOCK_SIZE)
        capacities, rates = capacity_curve(self.rag_trace, BLOCK_SIZE, 2, self.layers)
        if plot_path:
            measured = (self.sizes.rag_pool_blocks * self.num_groups, self.rag_hit_rate)
            plot(capacities, rates, ceiling / queried, measured, plot_path, BLOCK_SIZE)
        return {"capacity_blocks": capacities, "capacity_hit_rates": rates, "plot": plot_path}

    def compressed(self) -> dict:
        """DeepSeek-V4-Flash's cache geometry (catalog: windows of 128, CSA m = 4, HCA m' =
        128) replayed on the RAG trace with blocks of 128: a compressor goes on from a block's
        end only, so hits are whole blocks of lcm(block, m, m') = 128 tokens."""
        layers, bs = catalog_model("deepseek-v4-flash").layers, V4_BLOCK
        trace, pool = self.rag_trace, 4 * smallest_pool(self.rag_trace, V4_BLOCK, 2, layers)
        rate = replay_hit_rate(trace, pool, bs, 2, layers)
        ceiling, queried = ceiling_hit_tokens(trace, bs, whole_blocks=True)
        token_ceiling, _ = ceiling_hit_tokens(trace, 1)
        return {
            "v4_block_size": bs,
            "v4_rag_hit_rate": rate,
            "v4_rag_ceiling_hit_rate": ceiling / queried,
            "v4_hit_vs_ceiling_ratio": rate * queried / ceiling if ceiling else 0.0,
            "v4_vs_token_ceiling_ratio": rate * queried / token_ceiling,
        }


def _chat(
    engine: LLMEngine,
    schedule: list[ChatTurn],
    system: list[int],
    user: dict[tuple[int, int], list[int]],
    answer_len: int,
) -> list[list[int]]:
    """Run the turns in arrival order, each session's history growing by prompt and answer;
    return the prompts."""
    history: dict[int, list[int]] = {}
    prompts = []
    for t in schedule:
        prompt = history.get(t.session, system) + user[(t.session, t.turn)]
        params = SamplingParams(
            max_tokens=answer_len,
            temperature=0,
            ignore_eos=True,
            session=f"s{t.session}",
            tag="chat",
        )
        history[t.session] = prompt + _generate(engine, prompt, params)
        prompts.append(prompt)
    return prompts


def _generate(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    rid, outputs = engine.add_request(prompt, params), OutputAccumulator()
    while True:
        for out in outputs.add(engine.step()):
            if out.request_id == rid:
                return list(out.outputs[0].token_ids)


def _ttft(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> float:
    """Seconds from submission to the first token (the request asks for one)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, cache_salt=salt)
    start = time.perf_counter()
    _generate(engine, prompt, params)
    return time.perf_counter() - start


def _resumed(engine: LLMEngine, turn: list[int], repeats: int) -> float:
    """TTFT of `turn` with the pool emptied first: its prefix comes from the lower tiers."""
    times = []
    for _ in range(repeats):
        engine.reset_prefix_cache()
        times.append(_ttft(engine, turn))
    return min(times)


def _run_alternating(
    a: LLMEngine, b: LLMEngine, trace: list[list[int]], params: SamplingParams
) -> tuple[float, float]:
    """Each request on engine a, then on engine b, one at a time: their seconds in total.
    Alternating keeps a noisy host's slow phases from landing on one side only."""
    seconds = [0.0, 0.0]
    for prompt in trace:
        for i, engine in enumerate((a, b)):
            start = time.perf_counter()
            _generate(engine, prompt, params)
            seconds[i] += time.perf_counter() - start
    return seconds[0], seconds[1]
