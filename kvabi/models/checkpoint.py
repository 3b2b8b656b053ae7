"""What a loader returns: a `ModelConfig` and HF-equivalent weights in the chosen dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvabi.models.config import ModelConfig
from kvabi.models.deepseek_v3 import DeepseekV3Model
from kvabi.models.deepseek_v3_config import DeepseekV3Config
from kvabi.models.deepseek_v4 import DeepseekV4Model
from kvabi.models.deepseek_v4_config import DeepseekV4Config
from kvabi.models.deepseek_v32 import DeepseekV32Model
from kvabi.models.gemma3 import Gemma3Model
from kvabi.models.gemma3_config import Gemma3Config
from kvabi.models.gemma4 import Gemma4Model
from kvabi.models.gemma4_config import Gemma4Config
from kvabi.models.laguna import LagunaModel
from kvabi.models.laguna_config import LagunaConfig
from kvabi.models.llama import LlamaModel
from kvabi.native.cpu_kernels import has_native_bf16

AnyConfig = (
    ModelConfig | Gemma3Config | Gemma4Config | LagunaConfig | DeepseekV3Config | DeepseekV4Config
)
AnyModel = LlamaModel | Gemma3Model | Gemma4Model | LagunaModel | DeepseekV3Model | DeepseekV4Model
# architecture -> model class; every other architecture is a LlamaModel
MODEL_CLASSES: dict[str, type[AnyModel]] = {
    "deepseek_v3": DeepseekV3Model,
    "deepseek_v32": DeepseekV32Model,
    "deepseek_v4": DeepseekV4Model,
    "gemma3": Gemma3Model,
    "gemma4": Gemma4Model,
    "laguna": LagunaModel,
}

WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """fp32 or bf16, by name or as a torch dtype; `auto`: bf16 where the CPU computes it
    natively (`has_native_bf16`), else fp32. Anything else is a ValueError."""
    if dtype == "auto":
        return torch.bfloat16 if has_native_bf16() else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in WEIGHT_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[dtype.lower()]
    raise ValueError(f"dtype: {dtype!r} not supported; use auto or one of {sorted(WEIGHT_DTYPES)}")


@dataclass(frozen=True)
class Checkpoint:
    """Weights keyed by the model's parameter names (HF names without `model.`)."""

    config: AnyConfig
    state_dict: dict[str, torch.Tensor]

    def build(self) -> AnyModel:
        model_class = MODEL_CLASSES.get(self.config.architecture, LlamaModel)
        return model_class.from_state_dict(self.config, self.state_dict)  # type: ignore[arg-type]
