"""A tiny random Llama with a byte-level tokenizer: engine tests in milliseconds."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.models.config import ModelConfig
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel
from kvabi.models.tokenizer import Tokenizer

EOS = 256


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


def run_all(engine: LLMEngine, prompts, params) -> dict[str, object]:
    ids = [engine.add_request(p, params) for p in prompts]
    done, outputs = {}, OutputAccumulator()
    while engine.has_unfinished():
        for out in outputs.add(engine.step()):
            done[out.request_id] = out
    return [done[i] for i in ids]
