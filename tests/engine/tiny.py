"""A tiny random Llama with a byte-level tokenizer: engine tests in milliseconds."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.models.attention import ContiguousAttention
from kvabi.models.config import ModelConfig
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel
from kvabi.models.tokenizer import Tokenizer

EOS = 256
# Tests compare this model's greedy tokens exactly between runs that batch, chunk, block or
# cache a prompt differently, and across thread counts and CPU kinds. Those runs compute the
# same logits with GEMMs of other row counts and other kernels, which round differently:
# measured up to 8e-6 on fp32 logprobs (|logit| <= ~7) between 32 prompts in one batch and
# each alone. So equal tokens are guaranteed only where every step's top-2 logit margin is far
# above that: `greedy_reference` checks each step's margin against MIN_MARGIN, 100x the drift.
MIN_MARGIN = 1e-3


def tiny_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = EOS
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, {"eos_token": "<eos>"})


def tiny_loaded(seed: int = 0, layers: int = 2, dtype=torch.float32) -> LoadedModel:
    config = ModelConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=(EOS,),
    )
    torch.manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
    return LoadedModel(config, model.to(dtype).eval(), tiny_tokenizer())


def tiny_engine(seed: int = 0, **config) -> LLMEngine:
    return LLMEngine(tiny_loaded(seed), EngineConfig(**config), fingerprint="tiny")


@torch.no_grad()
def greedy_reference(
    prompt, max_tokens: int, seed: int = 0, loaded: LoadedModel | None = None
) -> tuple[int, ...]:
    """Greedy tokens independent of paging: one sequence, contiguous K/V, one token per forward.

    Fails at a step whose top-2 logit margin is under MIN_MARGIN: another run's GEMMs could
    round that step either way, so no test may compare its tokens exactly."""
    loaded = loaded or tiny_loaded(seed)
    model = loaded.model
    attn = ContiguousAttention.for_config(loaded.config)  # the config's layer windows
    ids = list(prompt)
    logits = model(torch.tensor(ids), torch.arange(len(ids)), attn)[-1]  # [vocab]
    out: list[int] = []
    for step in range(max_tokens):
        top = logits.topk(2).values
        margin = float(top[0] - top[1])
        assert margin > MIN_MARGIN, f"near-tie at step {step} of {ids}: margin {margin:.2g}"
        out.append(int(logits.argmax()))
        pos = len(ids) + len(out) - 1
        logits = model(torch.tensor(out[-1:]), torch.tensor([pos]), attn)[-1]
    return tuple(out)


def run_all(engine: LLMEngine, prompts, params) -> dict[str, object]:
    ids = [engine.add_request(p, params) for p in prompts]
    done, outputs = {}, OutputAccumulator()
    while engine.has_unfinished():
        for out in outputs.add(engine.step()):
            done[out.request_id] = out
    return [done[i] for i in ids]
