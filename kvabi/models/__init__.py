"""Llama-family models (Llama 2/3, SmolLM2, Mistral, Qwen2), Gemma 3 and 4 text, Laguna and
DeepSeek-V3 (MLA) and V3.2 (MLA with a lightning indexer): config, weights, tokenizer.

`load_model(name_or_path)` gives a `LoadedModel(config, model, tokenizer)`; the model's forward
takes flat token ids and positions and delegates attention per layer to an `AttentionFn`.
"""

from kvabi.models.attention import AttentionFn, ContiguousAttention
from kvabi.models.checkpoint import Checkpoint
from kvabi.models.config import ModelConfig, RopeScaling
from kvabi.models.deepseek_v3 import DeepseekV3Model
from kvabi.models.deepseek_v3_config import DeepseekV3Config
from kvabi.models.deepseek_v32 import DeepseekV32Model
from kvabi.models.gemma3 import Gemma3Model
from kvabi.models.gemma3_config import Gemma3Config
from kvabi.models.gemma4 import Gemma4Model
from kvabi.models.gemma4_config import Gemma4Config
from kvabi.models.gguf_loader import load_gguf
from kvabi.models.hf_loader import load_hf
from kvabi.models.laguna import LagunaModel
from kvabi.models.laguna_config import LagunaConfig
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelSource,
    load_model,
    resolve_model,
)
from kvabi.models.sparse_attention import ContiguousSparseAttention
from kvabi.models.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "AttentionFn",
    "Checkpoint",
    "ContiguousAttention",
    "ContiguousSparseAttention",
    "DeepseekV3Config",
    "DeepseekV3Model",
    "DeepseekV32Model",
    "Gemma3Config",
    "Gemma3Model",
    "Gemma4Config",
    "Gemma4Model",
    "LagunaConfig",
    "LagunaModel",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "Tokenizer",
    "load_gguf",
    "load_hf",
    "load_model",
    "resolve_model",
]
