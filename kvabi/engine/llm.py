"""`LLM`: the vLLM-shaped front of the engine: generate, stream and chat."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine, check_tp
from kvabi.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.threads import fit_threads
from kvabi.interop.model_spec import gguf_fingerprint, state_dict_fingerprint
from kvabi.models.registry import LoadedModel, load_model, resolve_model


class LLM:
    """`LLM(model=None).generate(prompts, SamplingParams(...))`; model None = the bundled one."""

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "auto",
        progress: bool = True,
        hooks: EngineHooks = EngineHooks(),
        tensor_parallel_size: int = 1,
        **engine_config: object,
    ) -> None:
        """`tensor_parallel_size` N > 1: N processes, each with its shard of the weights and
        KV heads (kvabi/engine/tp_group.py); this one is rank 0."""
        config = EngineConfig(**engine_config)  # checked before any rank starts
        fit_threads()  # torch's threads from the cores this process owns (threads.py)
        loaded = load_model(model, dtype, progress)
        fingerprint = model_fingerprint(model, loaded)
        if tensor_parallel_size == 1:
            self._attach(LLMEngine(loaded, config, fingerprint, hooks))
            return
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {tensor_parallel_size}")
        self._attach(tp_engine(model, loaded, fingerprint, config, hooks, tensor_parallel_size))

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, fingerprint: str = "", **engine_config: object
    ) -> LLM:
        """An LLM over an already loaded model (another layout, block size, ... of the same)."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(loaded, EngineConfig(**engine_config), fingerprint))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        checked = [self.engine.prompt_ids(p) for p in prompts]  # all before any work starts
        for ids in checked:
            self.engine.check_fits(len(ids), params.max_tokens)
        ids = [self.engine.add_request(p, params) for p in checked]
        done: dict[str, RequestOutput] = {}
        outputs = OutputAccumulator()
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in outputs.add(self.engine.step()):
                done[out.request_id] = out
                bar.update()
        bar.close()
        return [done[i] for i in ids]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[CompletionOutput]:
        """Yield each choice's deltas as the engine makes them (all n choices interleaved;
        each finish reported once).

        Text a stop string may still cut, or a half-decoded character, is held back until it
        settles (`outputs.py`); abandoning the iterator aborts the request."""
        params = params or SamplingParams()
        request_id = self.engine.add_request(prompt, params)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    yield from out.outputs
                    if out.finished:
                        return
        finally:
            if request_id in self.engine.requests:
                self.engine.abort(request_id)

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], params)[0]


def model_fingerprint(model: str | Path | None, loaded: LoadedModel) -> str:
    """The model's identity in descriptors: its GGUF file's, else its weights' digest."""
    source = resolve_model(model)
    if source.format == "gguf":
        return gguf_fingerprint(source.path)
    return state_dict_fingerprint(loaded.model.state_dict())


def tp_engine(
    model: str | Path | None,
    loaded: LoadedModel,
    fingerprint: str,
    config: EngineConfig,
    hooks: EngineHooks,
    size: int,
) -> LLMEngine:
    """Rank 0's engine over `size` ranks: the workers started and checked, then its shard."""
    import os

    from kvabi.engine.tp_group import TPGroup, agreement
    from kvabi.parallel.tp_shard import llama_plan, shard_llama

    check_tp(config, hooks)  # refused before any process starts
    plan = llama_plan(loaded, size)
    dtype = "bf16" if loaded.model.dtype == torch.bfloat16 else "fp32"
    name = "" if model is None else str(model)
    group = TPGroup.launch(name, dtype, size, threads=max(1, (os.cpu_count() or 1) // size))
    try:
        group.agree(agreement(fingerprint, plan, dtype))
        group.plan, group.kv_layers = plan, loaded.config.kv_layers()
        shard = shard_llama(loaded, plan, 0, group.reduce)
        return LLMEngine(shard, config, fingerprint, hooks, tp=group)
    except BaseException:
        group.close()
        raise
