"""`LLMEngine`: requests in, tokens out, one scheduler step at a time.

`add_request` validates and queues; `step` schedules, runs the model once over the paged cache,
samples, applies stop rules and returns what each request gained (deltas, `outputs.py`).
`abort` frees a request's blocks.

With the prefix cache (on by default) full blocks stay indexed by block hash after their request
ends, so later requests reuse them; with lower tiers configured (`EngineConfig.tiers`) blocks
the pool evicts are written down and found again there. A request's `session` keeps its
conversation: when the session's last request ends its blocks are demoted (written down and
put first in the pool's eviction order). `cache_stats()` reports it all.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace
from functools import partial

import torch

from kvabi.abi.descriptor import ATTN, CENTRIES, MLA, Descriptor, ModelSpec
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.cache.block_events import BlockEventSink
from kvabi.cache.block_groups import plan_groups
from kvabi.cache.kv_cache import KVCache
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_loader import PendingLoad
from kvabi.engine.assistant_draft import AssistantDrafting, window_slack
from kvabi.engine.fused_decode import FusedDecode
from kvabi.engine.kv_budget import max_seq_tokens, pool_blocks
from kvabi.engine.outputs import RequestOutput, request_delta
from kvabi.engine.paged_attention import LayerKV, PagedAttention
from kvabi.engine.press import PressConfig, PressJob, apply_press, press_jobs
from kvabi.engine.rejection_sampler import rejection_accept
from kvabi.engine.runner import ModelRunner
from kvabi.engine.sampler import sample, target_probs, token_logprob
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler, SchedulerConfig
from kvabi.engine.sequence import Sequence
from kvabi.engine.spec_decode import (
    SpecConfig,
    SpecStats,
    draft_cost,
    greedy_accept,
    next_backoff,
)
from kvabi.engine.tp_group import TPGroup
from kvabi.engine.tp_storage import TPStorage
from kvabi.models.decoder import Decoder
from kvabi.models.gemma4 import Gemma4Model
from kvabi.models.gemma4_assistant import Gemma4Assistant, load_gemma4_assistant
from kvabi.models.registry import LoadedModel

log = logging.getLogger("kvabi.engine")
KV_LAYOUTS = {"nhd": "vllm-flash-attn", "hnd": "vllm-flash-attn-hnd"}
MLA_LAYOUTS = {"nhd": "vllm-mla", "hnd": "vllm-mla"}  # an MLA latent has one head: no H axis
COMPRESSED_LAYOUT = "kvabi-compressed"  # DeepSeek V4: one K=V head and entries, one H either way


def kv_layout_preset(kv_layout: str, model: ModelSpec) -> str:
    """The preset of `EngineConfig.kv_layout` for this model: nhd/hnd name attention presets,
    for an MLA model (DeepSeek) vLLM's MLA layout, 576 values per token side by side, and for a
    model with compressed entries (DeepSeek V4) kvabi's (`kvabi-compressed`)."""
    if any(x.kind == CENTRIES for x in model.layers):
        return COMPRESSED_LAYOUT if kv_layout in ("nhd", "hnd") else kv_layout
    if any(x.kind == MLA for x in model.layers):
        return MLA_LAYOUTS.get(kv_layout, kv_layout)
    return KV_LAYOUTS.get(kv_layout, kv_layout)


# (the cache, layer_id, the sequences whose prompt this step completes)
PromptLayerHook = Callable[[KVCache, int, tuple[Sequence, ...]], None]


@dataclass(frozen=True)
class EngineConfig:
    kv_layout: str = "nhd"  # nhd, hnd, or any paged attention preset name
    block_size: int = 16
    num_blocks: int | None = None  # default: what kv_cache_bytes holds
    kv_cache_bytes: int = 512 * 2**20
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's context length
    attention_backend: str = "native"  # native, batched or reference (paged_attention.py)
    fused_decode: bool = True  # decode-only steps in one C++ call where it can (fused_decode.py)
    enable_prefix_caching: bool = True
    tiers: TierConfig = TierConfig()  # host / disk / Redis below the pool; default: none
    speculative: str | None = None  # e.g. "ngram:k=4,min=1,max=3" (spec_decode.py); off
    draft_model: str | None = None  # speculative="assistant:...": its folder (assistant_draft.py)

    def __post_init__(self) -> None:
        if self.tiers.is_enabled and not self.enable_prefix_caching:
            raise ValueError("tiers: lower tiers hold cached blocks; enable_prefix_caching")
        name = KV_LAYOUTS.get(self.kv_layout, self.kv_layout)
        if name not in PRESETS or not PRESETS[name].layout.is_paged:
            raise ValueError(f"kv_layout: 'nhd', 'hnd' or a paged preset, got {self.kv_layout!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        method = None if self.speculative is None else SpecConfig.parse(self.speculative).method
        if (method == "assistant") != (self.draft_model is not None):
            raise ValueError(
                "draft_model: speculative='assistant:...' takes a draft model folder, and only it"
            )


@dataclass(frozen=True)
class EngineHooks:
    """Callbacks fixed when the engine is built (a server's prefill role and KV events)."""

    # Called on the engine thread once a layer's K/V of a step are stored, with the sequences
    # whose prompt that step completes (a prefill instance sends a prompt's KV layer by
    # layer: kvabi/disagg/roles.py). It must not raise.
    on_prompt_layer: PromptLayerHook | None = None
    block_events: BlockEventSink | None = None  # told of each change to the cached blocks


@dataclass(frozen=True)
class EngineInfo:
    """What the engine found at start-up (never written back into the config)."""

    descriptor: Descriptor
    pool_blocks: tuple[int, ...]  # per block pool (one, unless layer geometries differ)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_kv_tokens: int  # the most tokens one sequence's KV can take (every pool to itself)

    @property
    def num_blocks(self) -> int:
        return sum(self.pool_blocks)


def model_spec(loaded: LoadedModel, fingerprint: str) -> ModelSpec:
    return ModelSpec(loaded.config.kv_layers(), fingerprint)


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig = EngineConfig(),
        fingerprint: str = "",
        hooks: EngineHooks = EngineHooks(),
        tp: TPGroup | None = None,
    ) -> None:
        """`tp`: rank 0 of a tensor-parallel group (kvabi/engine/tp_group.py), `loaded`
        its shard; the other ranks follow this engine's steps."""
        self.loaded, self.config, self.tokenizer = loaded, config, loaded.tokenizer
        self.hooks, self.tp = hooks, tp
        if tp is not None:
            check_tp(config, hooks)
        drafter = None if config.draft_model is None else _assistant(loaded, config.draft_model)
        self.info, slack = self._start(loaded, config, fingerprint, drafter, tp)
        self.cache = KVCache(
            self.info.descriptor,
            self.info.pool_blocks,
            config.enable_prefix_caching,
            config.tiers,
            hooks.block_events,
            KVStorage if tp is None else partial(_tp_storage, tp),
        )
        if tp is not None and config.tiers.is_enabled and not self.cache.plan.is_uniform:
            raise ValueError("tensor_parallel_size: tiers under TP need one full-attention group")
        if self.cache.has_compressed and config.speculative is not None:
            raise ValueError(
                "speculative: DeepSeek V4's compressors emit entries as tokens arrive and keep "
                "no history to roll a rejected draft back (transformers refuses it too)"
            )
        spec = None if config.speculative is None else SpecConfig.parse(config.speculative)
        if spec is not None and spec.exit_layer:
            _check_early_exit(loaded, spec.exit_layer)
        self.exit_layer = 0 if spec is None else spec.exit_layer  # early-exit drafting's E
        self.assistant = None  # the assistant drafter's step (assistant_draft.py), where set
        if drafter is not None:
            self.assistant = AssistantDrafting(drafter, loaded.model, LayerKV.of(self.cache))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self.cache,
            None if spec is None else spec.proposer(),
            self.info.max_model_len,
            0 if spec is None else spec.max_batch,
            slack,
            None if self.assistant is None else self.assistant.can_draft,
        )
        self.spec_stats = SpecStats()
        self.draft_cost = 0.0 if spec is None else draft_cost(spec, len(loaded.model.layers))
        self._sessions: dict[str, int] = {}  # live requests per session
        attention = PagedAttention(LayerKV.of(self.cache), config.attention_backend)
        model, kernels = loaded.model, attention.kernels  # prepared at load (LoadedModel)
        fused = None
        if config.fused_decode and self.cache.plan.is_uniform and tp is None:
            fused = FusedDecode.build(model, self.cache.storage, kernels)
        self.runner = ModelRunner(model, attention, self.cache.groups, fused)
        self.runner.keep_hidden = self.assistant is not None
        if tp is not None:  # the workers' caches: as many blocks as this one's, no tiers
            self.runner.tp = tp  # (rank 0 moves whole blocks to and from them: TPStorage)
            tp.setup(replace(config, num_blocks=self.info.pool_blocks[0], tiers=TierConfig()))
        self.requests: dict[str, list[Sequence]] = {}
        self._loads: dict[int, tuple[Sequence, PendingLoad]] = {}  # reads below host RAM
        self.num_computed_tokens = 0  # tokens run through the model, ever: progress
        self._ids = itertools.count()

    @staticmethod
    def _start(
        loaded: LoadedModel,
        config: EngineConfig,
        fingerprint: str,
        drafter: Gemma4Assistant | None,
        tp: TPGroup | None = None,
    ) -> tuple[EngineInfo, int]:
        """What the engine finds at start-up, and the keys its sliding groups keep before
        their windows for `drafter` (counted in their blocks as part of a step's chunk).
        Under TP (`loaded` rank 0's shard) the descriptor is the whole model's cache, every
        rank's heads, and the block count what rank 0's heads fit."""
        dtype = "bf16" if loaded.model.dtype == torch.bfloat16 else "f32"
        spec = model_spec(loaded, fingerprint)
        name = kv_layout_preset(config.kv_layout, spec)
        kwargs = {"block_size": config.block_size}
        if PRESETS[name].layout.quant == "none":  # the model's dtype; a codec keeps its own
            kwargs["dtype"] = dtype
        desc = preset_descriptor(name, spec, **kwargs)  # what this process's tensors hold
        plan = plan_groups(desc.model)
        slack = 0 if drafter is None else window_slack(drafter, loaded.config, plan)
        chunk = config.max_num_batched_tokens + slack
        max_len = config.max_model_len or loaded.config.max_position_embeddings
        blocks = (config.num_blocks,) * len(plan.pool_specs) if config.num_blocks else None
        blocks = blocks or pool_blocks(desc, plan, config.kv_cache_bytes, max_len, chunk)
        limit = sum(blocks) * config.block_size
        max_kv = max_seq_tokens(plan, blocks, config.block_size, chunk, limit)
        if tp is not None:
            desc = preset_descriptor(name, ModelSpec(tp.kv_layers, fingerprint), **kwargs)
        return EngineInfo(desc, blocks, max_len, loaded.stop_token_ids, max_kv), slack

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises ValueError for input that cannot be served."""
        ids = self.prompt_ids(prompt)
        self.check_fits(len(ids), params.max_tokens)
        if params.press is not None:
            self.check_press(len(ids), params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seq = self._new_seq(request_id, 0, tuple(ids), params)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        if params.session is not None:
            self._sessions[params.session] = self._sessions.get(params.session, 0) + 1
        return request_id

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, checked against the context window, the cache and the vocab."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: must not be empty")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens; the context window is {limit} "
                f"(prompt must be at most {limit - 1} tokens)"
            )
        if len(ids) + 1 > self.max_kv_tokens:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit the KV cache "
                f"({self.info.num_blocks} blocks of {self.config.block_size})"
            )
        vocab = self.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens one sequence's KV can take, with every pool to itself (a sliding
        group holds only its window and a step's chunk: `kv_budget.max_seq_tokens`)."""
        return self.info.max_kv_tokens

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Refuse what could never finish: the last token's KV is never stored, so a sequence
        needs room for prompt + max_tokens - 1 tokens (preemption can free the rest)."""
        need = num_prompt + max_tokens - 1
        if need > self.max_kv_tokens:
            raise ValueError(
                f"max_tokens: {max_tokens} with a {num_prompt}-token prompt needs KV for {need} "
                f"tokens; the KV cache holds {self.max_kv_tokens} ({self.info.num_blocks} blocks "
                f"of {self.config.block_size}), so at most {self.max_kv_tokens + 1 - num_prompt}"
            )

    def check_press(self, num_prompt: int, params: SamplingParams) -> None:
        """Refuse a press (press.py) this engine cannot apply to this prompt."""
        assert params.press is not None
        p = PressConfig.parse(params.press)
        p.context_len(num_prompt)
        layers = self.cache.desc.model.layers
        if not self.cache.plan.is_uniform or any(x.kind != ATTN for x in layers):
            raise ValueError("press: a model whose layers all cache full-attention K/V only")
        if self.tp is not None or self.config.speculative is not None or params.n != 1:
            raise ValueError("press: not with tensor parallelism, speculation or n > 1")
        if p.method == "snapkv" and p.window > self.config.max_num_batched_tokens:
            raise ValueError(
                f"press: snapkv's window ({p.window}) needs max_num_batched_tokens >= it "
                f"({self.config.max_num_batched_tokens}): its queries are scored in one step"
            )

    def _new_seq(
        self, request_id: str, index: int, ids: tuple[int, ...], params: SamplingParams
    ) -> Sequence:
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed + index)
        seq_id = next(self._ids)
        seq = Sequence(seq_id, request_id, index, ids, params, seq_id, gen)
        seq.press = None if params.press is None else PressConfig.parse(params.press)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def abort(self, request_id: str) -> None:
        seqs = self.requests.pop(request_id, [])
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if seqs:
            self._end_request(seqs)

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a delta of each request that progressed (what is new
        since its last one; a finished request's delta is its last)."""
        self._promote_waiting()
        batch = self.scheduler.schedule()  # evicted blocks were written down as allocated
        for pool_id, storage in enumerate(self.cache.storages):
            copies = [c for c in batch.copies if c.pool_id == pool_id]
            if copies:
                storage.copy_blocks([c.src for c in copies], [c.dst for c in copies])
        if not batch.seqs:
            self._wait_for_loads()
            return []
        self.num_computed_tokens += batch.num_tokens
        drafted = None
        if self.exit_layer and any(s.draft for s in batch.seqs):
            drafted = self.runner.draft(batch, self.exit_layer)  # fills the drafts
            batch = drafted.batch
        if self.assistant is not None and any(s.draft for s in batch.seqs):
            batch = self.assistant.fill(batch)
        jobs = press_jobs(batch)
        self.runner.attention.presses = jobs  # each layer picks its kept tokens (press.py)
        logits = self.runner.run(batch, self._layer_hook(batch), drafted)
        self.runner.attention.presses = {}
        touched = self._postprocess(batch, logits)
        self._press(batch, jobs)
        outputs = [request_delta(r, self.requests[r]) for r in touched]
        for out in outputs:
            if out.finished:
                self._end_request(self.requests.pop(out.request_id))
        if self.cache.has_compressed:  # the compressors' states of sequences still running
            self.runner.attention.compressors.retain({q.seq_id for q in self.scheduler.running})
        return outputs

    def _press(self, batch: ScheduledBatch, jobs: dict[int, PressJob]) -> None:
        """Keep each pressed context's chosen tokens; free the blocks past them."""
        for s in batch.seqs:
            job = jobs.get(s.seq.seq_id)
            if job is not None and not s.seq.is_finished:
                apply_press(job, s.seq, self.cache.storage)
                self.scheduler.trim(s.seq)

    def _layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        hook = self.hooks.on_prompt_layer
        if hook is None:
            return None
        seqs = tuple(
            s.seq for s in batch.seqs if s.start < len(s.seq.prompt_ids) <= s.start + s.num_tokens
        )
        return (lambda layer_id: hook(self.cache, layer_id, seqs)) if seqs else None

    def cache_stats(self) -> dict[str, float]:
        """Prefix cache and tier metrics as flat `name -> value` (kvabi/cache/cache_stats.py)."""
        return self.cache.flat_stats()

    def cache_tags(self) -> tuple[str, ...]:
        """The request tags whose `tag_<tag>_*` figures `cache_stats()` holds."""
        return tuple(self.cache.stats.tags)

    def reset_prefix_cache(self) -> int:
        """Forget every pool's unreferenced cached blocks (lower tiers keep theirs); return how
        many were dropped."""
        return self.cache.drop_cached()

    def flush_tiers(self) -> None:
        """Wait until every queued write-down has reached the lower tiers."""
        self.cache.flush()

    def close(self) -> None:
        """Finish queued write-downs and release the tiers (their connections and thread);
        stop the tensor-parallel workers."""
        self.cache.close()
        if self.tp is not None:
            self.tp.close()

    def _promote_waiting(self) -> None:
        """Load from the lower tiers what the next admissible waiting requests will reuse:
        from host RAM at once; from below it on the loader's thread, the request waiting
        until its read is done and placed (kvabi/cache/tier_loader.py)."""
        if self.cache.tiers is None:
            return
        self._place_loads()
        room = self.config.max_num_seqs - len(self.scheduler.running)
        for seq in self.scheduler.waiting[: max(room, 0)]:
            if not seq.is_promoted:
                seq.is_promoted = True
                try:
                    load = self.cache.start_load(self.scheduler.block_keys(seq))
                except Exception:  # the pool is consistent (promote frees what it pinned)
                    log.exception("loading %s from the lower tiers failed", seq.request_id)
                    continue
                if load is not None:
                    seq.is_loading = True
                    self._loads[seq.seq_id] = (seq, load)

    def _place_loads(self) -> None:
        """Place the reads that are done; their requests may be admitted."""
        for seq_id, (seq, load) in list(self._loads.items()):
            if load.is_done:
                del self._loads[seq_id]
                seq.is_loading = False
                try:
                    self.cache.finish_load(load)
                except Exception:
                    log.exception("placing %s's blocks from the lower tiers failed", seq.request_id)

    def _wait_for_loads(self) -> None:
        """Nothing to run but reads under way: wait for the first (not spin on the step)."""
        if self._loads:
            futures = [load.future for _, load in self._loads.values()]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)

    def _end_request(self, seqs: list[Sequence]) -> None:
        """A request left; when it was its session's last, demote the session's blocks."""
        session = seqs[0].params.session
        if session is None:
            return
        self._sessions[session] -= 1
        if self._sessions[session] > 0:
            return
        del self._sessions[session]
        hashes = list(dict.fromkeys(h for s in seqs for h in s.block_hashes[: s.num_cached_blocks]))
        self.cache.demote(hashes)

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[str]:
        touched: dict[str, None] = {}
        row = 0
        argmax = logits.argmax(dim=-1).tolist()  # one call for every greedy row of the step
        hidden = self.runner.hidden  # kept for an assistant drafter, else None
        for s in batch.seqs:
            if s.draft:
                rows = slice(row, row + len(s.draft) + 1)
                self._guarded(s.seq, self._verify, s, logits[rows], argmax[rows])
                if hidden is not None:  # at the last accepted position (what drafts next)
                    _keep_hidden(s.seq, hidden[row + s.seq.num_computed - 1 - s.start])
                touched[s.seq.request_id] = None
                row = rows.stop
                continue
            s.seq.num_computed = s.start + s.num_tokens
            self.scheduler.cache_computed(s.seq)
            if not s.samples:
                continue
            if hidden is not None:
                _keep_hidden(s.seq, hidden[row])
            self._guarded(s.seq, self._next_token, s.seq, logits[row], argmax[row])
            touched[s.seq.request_id] = None
            row += 1
        return list(touched)

    def _guarded(self, seq: Sequence, fn: Callable[..., None], *args: object) -> None:
        """Sample or verify for one sequence: if it raises, its request fails alone and the
        batch goes on; a sibling's failure may have ended it this step already."""
        if seq.is_finished:
            return
        try:
            fn(*args)
        except Exception as exc:
            self._fail(seq.request_id, exc)

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor, argmax: list[int]) -> None:
        """Emit what verification accepts (greedily, or by rejection sampling when the
        sequence samples); K/V counts as computed only for the last token and the accepted
        draft tokens, and the rest is trimmed (spec_decode.py)."""
        seq, p = s.seq, s.seq.params
        if p.is_greedy:
            emit = greedy_accept(s.draft, argmax)
        else:
            emit = rejection_accept(s.draft, target_probs(logits, p), seq.generator)
        self.spec_stats.record(len(s.draft), len(emit) - 1)
        wait = next_backoff(seq.spec_backoff, len(emit) - 1, self.draft_cost)
        seq.spec_backoff = seq.spec_skip = wait
        for i, token in enumerate(emit):
            seq.num_computed = s.start + 1 + i  # before `token`: it may end the sequence
            self.scheduler.cache_computed(seq)
            self._append(seq, token, token_logprob(logits[i], token, p))
            if seq.is_finished:
                return
        self.scheduler.trim(seq)

    def _next_token(self, seq: Sequence, logits: torch.Tensor, argmax: int) -> None:
        if seq.params.n > 1 and not seq.output_ids and seq.index == 0:
            self._fork(seq, logits)
        p = seq.params
        if p.is_greedy and p.logprobs is None:
            self._append(seq, argmax, None)
        else:
            self._append(seq, *sample(logits, p, seq.generator))

    def _fail(self, request_id: str, exc: Exception) -> None:
        """End every sequence of the request with `finish_reason` "error" (blocks freed)."""
        log.exception("request %s failed while sampling or stopping", request_id)
        for seq in self.requests[request_id]:
            seq.error = f"{type(exc).__name__}: {exc}"
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> None:
        """n > 1: children share all of the parent's prompt blocks; whoever first writes into
        the shared last block gets a copy of it (copy on write)."""
        for index in range(1, parent.params.n):
            child = self._new_seq(parent.request_id, index, parent.prompt_ids, parent.params)
            child.arrival = parent.arrival
            self.scheduler.share_blocks(parent, child)
            child.num_computed = parent.num_computed
            child.block_hashes, child.hash_root = list(parent.block_hashes), parent.hash_root
            child.num_cached_blocks, child.is_counted = parent.num_cached_blocks, True
            child.spec_hidden, child.spec_hidden_at = parent.spec_hidden, parent.spec_hidden_at
            self.requests[parent.request_id].append(child)
            self._append(child, *sample(logits, child.params, child.generator))
            if not child.is_finished:
                self.scheduler.add_running(child)

    def _append(self, seq: Sequence, token: int, logprob: object) -> None:
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self._stop_reason(seq, token)
        if reason:
            self.scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Decode the new token onto `seq.text` and say whether the sequence ends here."""
        p, detok = seq.params, seq.detokenizer
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.info.eos_token_ids):
            seq.text += detok.flush(self.tokenizer)  # a stop token adds no text of its own
            return "stop"
        is_full = len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.info.max_model_len
        new = detok.add(self.tokenizer, token) + (detok.flush(self.tokenizer) if is_full else "")
        seq.text += new
        if _cut_at_stop(seq, len(new)):
            return "stop"
        return "length" if is_full else None  # add_request made sure the cache holds max_tokens


def _check_early_exit(loaded: LoadedModel, exit_layer: int) -> None:
    model = loaded.model
    if not 1 <= exit_layer < len(model.layers):
        raise ValueError(
            f"speculative: exit must be in [1, {len(model.layers) - 1}], got {exit_layer}"
        )
    if type(model).run_layers is Decoder.run_layers:
        raise ValueError(
            f"speculative: early-exit needs a model that runs its layers in parts; "
            f"{type(model).__name__} does not"
        )


def check_tp(config: EngineConfig, hooks: EngineHooks) -> None:
    """What tensor parallelism does not run yet: refused before any step."""
    if config.speculative is not None and SpecConfig.parse(config.speculative).method != "ngram":
        raise ValueError("tensor_parallel_size: of the speculative methods, ngram only")
    if hooks.on_prompt_layer is not None:
        raise ValueError(
            "tensor_parallel_size: a layer-streaming prefill would send rank 0's heads; "
            "under TP a prefill instance sends the whole blocks once the prompt is computed"
        )


def _tp_storage(tp: TPGroup, desc: Descriptor, num_blocks: int) -> KVStorage:
    return TPStorage(desc, num_blocks, tp, pool_id=0)


def _assistant(loaded: LoadedModel, folder: str) -> Gemma4Assistant:
    """The assistant drafter for `loaded` (a Gemma 4 target) from its HF folder."""
    if not isinstance(loaded.model, Gemma4Model):
        raise ValueError(
            f"speculative: an assistant drafter needs a Gemma 4 target, "
            f"not {type(loaded.model).__name__}"
        )
    return load_gemma4_assistant(folder, loaded.model.config, loaded.model.dtype)


def _keep_hidden(seq: Sequence, hidden: torch.Tensor) -> None:
    """Keep the target's hidden state at position num_computed - 1 (it drafts the next step)."""
    if not seq.is_finished and seq.num_computed - 1 >= 0:
        seq.spec_hidden, seq.spec_hidden_at = hidden.clone(), seq.num_computed - 1


def _cut_at_stop(seq: Sequence, num_new: int) -> bool:
    """Cut `seq.text` at the first stop string that the new text completes. Only the tail can
    hold one (earlier text was searched before), and `seq.text` still holds the last
    `len(stop) - 1` characters before the new ones (outputs.py holds them back)."""
    for stop in seq.params.stop:
        at = seq.text.find(stop, max(len(seq.text) - num_new - len(stop) + 1, 0))
        if at >= 0:
            seq.text = seq.text[:at]
            return True
    return False
