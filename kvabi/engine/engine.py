"""`LLMEngine`: requests in, tokens out, one scheduler step at a time.

`add_request` validates and queues; `step` schedules, runs the model once over the paged cache,
samples, applies stop rules and returns what changed. `abort` frees a request's blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.cache.block_pool import BlockPool
from kvabi.cache.kv_storage import KVStorage
from kvabi.engine.outputs import RequestOutput, request_output
from kvabi.engine.paged_attention import PagedAttention
from kvabi.engine.runner import ModelRunner
from kvabi.engine.sampler import sample
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvabi.engine.sequence import Sequence
from kvabi.models.registry import LoadedModel

KV_LAYOUTS = {"nhd": "vllm-flash-attn", "hnd": "vllm-flash-attn-hnd"}


@dataclass(frozen=True)
class EngineConfig:
    kv_layout: str = "nhd"  # nhd, hnd, or any paged attention preset name
    block_size: int = 16
    num_blocks: int | None = None  # default: what kv_cache_bytes holds
    kv_cache_bytes: int = 512 * 2**20
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's context length
    attention_backend: str = "batched"

    def __post_init__(self) -> None:
        name = KV_LAYOUTS.get(self.kv_layout, self.kv_layout)
        if name not in PRESETS or not PRESETS[name].layout.is_paged:
            raise ValueError(f"kv_layout: 'nhd', 'hnd' or a paged preset, got {self.kv_layout!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class EngineInfo:
    """What the engine found at start-up (never written back into the config)."""

    descriptor: Descriptor
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def model_spec(loaded: LoadedModel, fingerprint: str) -> ModelSpec:
    c = loaded.config
    layer = LayerSpec(ATTN, c.num_kv_heads, c.head_dim, c.head_dim)
    return ModelSpec((layer,) * c.num_layers, fingerprint)


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), fingerprint: str = ""
    ) -> None:
        self.loaded, self.config, self.tokenizer = loaded, config, loaded.tokenizer
        self.info = self._start(loaded, config, fingerprint)
        self.storage = KVStorage(self.info.descriptor, self.info.num_blocks)
        self.pool = BlockPool(self.info.num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self.pool,
            config.block_size,
        )
        attention = PagedAttention(self.storage, config.attention_backend)
        self.runner = ModelRunner(loaded.model.fuse_projections(), attention)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()

    @staticmethod
    def _start(loaded: LoadedModel, config: EngineConfig, fingerprint: str) -> EngineInfo:
        dtype = "bf16" if loaded.model.dtype == torch.bfloat16 else "f32"
        desc = preset_descriptor(
            KV_LAYOUTS.get(config.kv_layout, config.kv_layout),
            model_spec(loaded, fingerprint),
            block_size=config.block_size,
            dtype=dtype,
        )
        per_block = sum(s.num_bytes for s in buffer_specs(desc, 1))  # without allocating
        num_blocks = config.num_blocks or max(config.kv_cache_bytes // per_block, 1)
        max_len = config.max_model_len or loaded.config.max_position_embeddings
        window = loaded.config.sliding_window
        if window is not None:  # paged attention attends to everything: stay inside the window
            max_len = min(max_len, window)
        return EngineInfo(desc, num_blocks, max_len, loaded.stop_token_ids)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises ValueError for input that cannot be served."""
        ids = self.prompt_ids(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seq = self._new_seq(request_id, 0, ids, params)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
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
        if -(-(len(ids) + 1) // self.config.block_size) > self.info.num_blocks:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit the KV cache "
                f"({self.info.num_blocks} blocks of {self.config.block_size})"
            )
        vocab = self.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")

    def _new_seq(
        self, request_id: str, index: int, ids: list[int], params: SamplingParams
    ) -> Sequence:
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed + index)
        seq_id = next(self._ids)
        return Sequence(seq_id, request_id, index, ids, params, seq_id, gen)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def abort(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the requests that progressed (finished ones last time)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        logits = self.runner.run(batch)
        touched = self._postprocess(batch, logits)
        outputs = [request_output(r, self.requests[r]) for r in touched]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[str]:
        touched: dict[str, None] = {}
        row = 0
        argmax = logits.argmax(dim=-1).tolist()  # one call for every greedy row of the step
        for s in batch.seqs:
            s.seq.num_computed = s.start + s.num_tokens
            if not s.samples:
                continue
            if s.seq.params.n > 1 and not s.seq.output_ids and s.seq.index == 0:
                self._fork(s.seq, logits[row])
            p = s.seq.params
            if p.is_greedy and p.logprobs is None:
                self._append(s.seq, argmax[row], None)
            else:
                self._append(s.seq, *sample(logits[row], p, s.seq.generator))
            touched[s.seq.request_id] = None
            row += 1
        return list(touched)

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> None:
        """n > 1: children share the parent's full prompt blocks and recompute the rest."""
        full = parent.num_computed // self.config.block_size
        for index in range(1, parent.params.n):
            child = self._new_seq(parent.request_id, index, parent.prompt_ids, parent.params)
            child.arrival = parent.arrival
            child.block_ids = parent.block_ids[:full]
            self.pool.share(child.block_ids)
            child.num_computed = full * self.config.block_size
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
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.info.eos_token_ids):
            seq.text = self.tokenizer.decode(seq.output_ids[:-1], skip_special_tokens=True)
            return "stop"
        seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        for stop in p.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at]
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.info.max_model_len:
            return "length"
        if -(-seq.num_tokens // self.config.block_size) > self.info.num_blocks:
            return "length"  # could never fit the cache, even alone
        return None
