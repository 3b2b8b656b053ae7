"""Seeded workloads for `kvabi bench prefix`, the infinite-cache ceiling, and a model-free replay.

- `rag_trace`: per request, a fixed system prompt + 3 distinct documents drawn from a pool with
  Zipf popularity + a question.
- `chat_schedule`: sessions of several turns; each session's next turn arrives an exponential
  think time after its previous one, and turns run in arrival order, so sessions interleave.
- `ceiling_hit_tokens`: what an infinite cache finds on a trace: for each request, the leading
  blocks whose hashes some earlier request had (capped, like the engine, at all tokens but one).
- `replay_hit_rate`: a trace through the engine's own scheduler, block pool and prefix cache
  with a pool of a given size and no model (each output token is a filler): the hit rate that
  pool capacity gets. It runs in milliseconds, so the capacity curve is measured, not modelled.
  `layers` gives the model's layer kinds and windows (`replay_layers`), so a hybrid model's
  block groups replay as the engine runs them; the geometry is shrunk to one number per token.

The ceiling holds for hybrid models too: an infinite cache keeps every group's blocks, so a
sliding group always has the window before the hit point, and full attention decides.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.descriptor import ATTN, CENTRIES, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_groups import plan_groups
from kvabi.cache.kv_cache import KVCache
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import Scheduler, SchedulerConfig
from kvabi.engine.sequence import Sequence as Seq

DIGEST = "0" * 32  # the replay's own model: any digest gives the same hit counts
FILLER_TOKEN = 0
ONE_LAYER = (LayerSpec(ATTN, 1, 1, 1),)  # the replay needs ids and hashes, hardly any storage


@dataclass(frozen=True)
class RagShape:
    num_requests: int
    num_docs: int
    doc_len: int
    system_len: int = 128
    question_len: int = 16
    docs_per_request: int = 3
    zipf_s: float = 1.1


@dataclass(frozen=True)
class ChatTurn:
    session: int
    turn: int
    arrival: float  # virtual seconds


def corpus_slicer(corpus: Sequence[int], rng: random.Random) -> Callable[[int], list[int]]:
    """A function returning a random run of `n` tokens of the corpus."""

    def take(n: int) -> list[int]:
        start = rng.randrange(len(corpus) - n)
        return list(corpus[start : start + n])

    return take


def rag_trace(corpus: Sequence[int], shape: RagShape, seed: int = 0) -> list[list[int]]:
    """Token ids of each request: system prompt, 3 Zipf-popular documents, a question."""
    rng = random.Random(seed)
    take = corpus_slicer(corpus, rng)
    system = take(shape.system_len)
    docs = [take(shape.doc_len) for _ in range(shape.num_docs)]
    weights = [1 / (rank + 1) ** shape.zipf_s for rank in range(shape.num_docs)]
    trace = []
    for _ in range(shape.num_requests):
        picked: list[int] = []
        while len(picked) < shape.docs_per_request:
            (d,) = rng.choices(range(shape.num_docs), weights)
            if d not in picked:
                picked.append(d)
        trace.append(system + sum((docs[d] for d in picked), []) + take(shape.question_len))
    return trace


def chat_schedule(
    num_sessions: int, num_turns: int, mean_think_s: float, seed: int = 0
) -> list[ChatTurn]:
    """Every session's turns in arrival order; a turn takes 1 virtual second to answer."""
    rng = random.Random(seed)
    turns = []
    for s in range(num_sessions):
        t = rng.uniform(0, mean_think_s)
        for k in range(num_turns):
            turns.append(ChatTurn(s, k, t))
            t += 1 + rng.expovariate(1 / mean_think_s)
    return sorted(turns, key=lambda x: x.arrival)


def ceiling_hit_tokens(
    prompts: Sequence[Sequence[int]], block_size: int, whole_blocks: bool = False
) -> tuple[int, int]:
    """(hit tokens, query tokens) of an infinite cache on this trace; `whole_blocks`: hits end
    at a block boundary (a cache of compressed entries, DeepSeek V4)."""
    root = root_hash(DIGEST)
    seen: set[bytes] = set()
    hits = queried = 0
    for p in prompts:
        hashes = hash_blocks(p, block_size, root)
        n = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        hit = min(n * block_size, len(p) - 1)
        hits += hit - hit % block_size if whole_blocks else hit
        queried += len(p)
        seen.update(hashes)
    return hits, queried


def replay_layers(layers: Sequence[LayerSpec]) -> tuple[LayerSpec, ...]:
    """A model's layers for the replay: kinds, windows, sharing and ratios kept, 1-wide KV."""
    return tuple(_narrow(x) for x in layers)


def _narrow(layer: LayerSpec) -> LayerSpec:
    if layer.kind == ATTN:
        return replace(layer, num_kv_heads=1, k_dim=1, v_dim=1)
    if layer.kind == CENTRIES:
        return replace(layer, latent_dim=1, indexer_dim=min(layer.indexer_dim, 1))
    return layer


def num_block_groups(layers: Sequence[LayerSpec]) -> int:
    """How many block tables a sequence of this model has (1 for a uniform model)."""
    return len(plan_groups(ModelSpec(tuple(layers), DIGEST)).groups)


def smallest_pool(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    max_tokens: int,
    layers: Sequence[LayerSpec] = ONE_LAYER,
) -> int:
    """Blocks that hold the longest request whole in every block group, plus one each."""
    per_group = -(-(max(map(len, prompts)) + max_tokens) // block_size) + 1
    return num_block_groups(layers) * per_group


def replay_hit_rate(
    prompts: Sequence[Sequence[int]],
    num_blocks: int,
    block_size: int,
    max_tokens: int,
    layers: Sequence[LayerSpec] = ONE_LAYER,
) -> float:
    """The hit rate of a pool of `num_blocks` on the trace, one request at a time, no model."""
    smallest = smallest_pool(prompts, block_size, max_tokens, layers)
    if num_blocks < smallest:  # the scheduler would wait for blocks forever
        raise ValueError(f"num_blocks: {num_blocks} cannot hold a request; needs {smallest}")
    model = ModelSpec(replay_layers(layers), DIGEST)
    compressed = any(x.kind == CENTRIES for x in layers)
    preset = "kvabi-compressed" if compressed else "vllm-flash-attn"
    desc = preset_descriptor(preset, model, block_size=block_size, dtype="f32")
    config = SchedulerConfig(max_num_batched_tokens=max(len(p) for p in prompts) + max_tokens)
    sched = Scheduler(config, KVCache(desc, num_blocks))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        seq = Seq(i, f"r{i}", 0, list(prompt), params, arrival=i)
        sched.add(seq)
        while not seq.is_finished:
            for s in sched.schedule().seqs:
                s.seq.num_computed = s.start + s.num_tokens
                sched.cache_computed(s.seq)
                if s.samples:
                    s.seq.output_ids.append(FILLER_TOKEN)
                    if len(s.seq.output_ids) >= max_tokens:
                        sched.finish(s.seq, "length")
    q = sched.stats.prefix
    return q.hit_tokens / q.query_tokens


def capacity_curve(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    max_tokens: int,
    layers: Sequence[LayerSpec] = ONE_LAYER,
) -> tuple[list[int], list[float]]:
    """Replayed hit rates for pool sizes doubling from the smallest that holds one request
    to twice the trace's distinct blocks (where every pool reaches the ceiling); every block
    group of the model takes its blocks from the one pool."""
    smallest = smallest_pool(prompts, block_size, max_tokens, layers)
    root = root_hash(DIGEST)
    distinct = num_block_groups(layers) * len(
        {h for p in prompts for h in hash_blocks(p, block_size, root)}
    )
    capacities, c = [], smallest
    while c < 2 * (distinct + smallest):
        capacities.append(c)
        c *= 2
    capacities.append(2 * (distinct + smallest))
    return capacities, [
        replay_hit_rate(prompts, c, block_size, max_tokens, layers) for c in capacities
    ]
