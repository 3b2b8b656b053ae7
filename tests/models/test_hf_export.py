"""The bundled SmolLM2 exported as an HF folder reloads in transformers with our logits and ids.

The folder is what vLLM loads in `kvabi bench throughput`, so "same model" there rests on this.
Weights are written in fp32 without change; the logits differ only by kernel summation order
(the GGUF comparison in tests/models measures ~1e-4, bound 1e-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvabi.models import ContiguousAttention, LoadedModel, load_model
from kvabi.models.hf_export import export_hf_folder
from tests.conftest import assert_argmax_agrees

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LOGIT_TOLERANCE = 1e-3
TEXTS = ["What is the capital of France?", "Numbers 12345 and  spaces\n\nnewlines, émigré 日本"]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(progress=False)


@pytest.fixture(scope="module")
def folder(ours: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf_folder(ours, tmp_path_factory.mktemp("hf") / "smollm2")


def test_folder_holds_the_checkpoint_files(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_key_value_heads"], config["head_dim"], config["tie_word_embeddings"]) == (
        3,
        64,
        True,
    )


@torch.inference_mode()
def test_transformers_gives_our_logits(ours: LoadedModel, folder: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    message = [{"role": "user", "content": TEXTS[0]}]
    ids = torch.tensor(ours.tokenizer.apply_chat_template(message, add_generation_prompt=True))
    logits = ours.model(
        ids, torch.arange(ids.shape[0]), ContiguousAttention.for_config(ours.config)
    )
    expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    # the argmax may swap only where HF's top two are within 2 x the bound (none here)
    assert_argmax_agrees(logits, expected, LOGIT_TOLERANCE)


def test_transformers_tokenizer_encodes_like_ours(ours: LoadedModel, folder: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert theirs.encode(text) == ours.tokenizer.encode(text)
    message = [{"role": "user", "content": TEXTS[0]}]
    assert theirs.apply_chat_template(
        message, add_generation_prompt=True, tokenize=False
    ) == ours.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    assert (theirs.bos_token, theirs.eos_token) == (
        ours.tokenizer.special_tokens.get("bos_token"),
        ours.tokenizer.special_tokens.get("eos_token"),
    )


def test_our_loader_reads_it_back_bit_identically(ours: LoadedModel, folder: Path) -> None:
    again = load_model(folder, progress=False)
    assert again.config == ours.config
    for name, weight in ours.model.state_dict().items():
        assert torch.equal(weight, again.model.state_dict()[name]), name
