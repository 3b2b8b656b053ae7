"""HF folder (config.json + safetensors) -> our model: logits equal transformers' in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvabi.models import RopeScaling, load_hf
from kvabi.models.errors import CheckpointError, MissingFieldError, UnknownArchitectureError
from kvabi.models.hf_loader import read_hf_config
from tests.models.tiny import LLAMA3_ROPE, TINY, hf_logits, make_hf, our_logits, random_ids

pytest.importorskip("transformers")
BF16_LOGIT_TOL = 0.1

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
}


def _saved(tmp_path: Path, variant: str) -> tuple[torch.nn.Module, Path]:
    arch, overrides = VARIANTS[variant]
    hf = make_hf(arch, **overrides)
    hf.save_pretrained(tmp_path)  # safetensors
    assert list(tmp_path.glob("*.safetensors"))
    return hf, tmp_path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers(tmp_path: Path, variant: str) -> None:
    hf, folder = _saved(tmp_path, variant)
    model = load_hf(folder, progress=False).build()
    ids = random_ids(24)
    expected = hf_logits(hf, ids)
    assert expected.abs().max() > 1.0  # weights are large enough for the check to bite
    torch.testing.assert_close(our_logits(model, ids), expected, atol=1e-5, rtol=0)


def test_config_from_folder(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "qwen2")
    config = load_hf(folder, progress=False).config
    assert (config.architecture, config.attention_bias, config.attention_out_bias) == (
        "qwen2",
        True,
        False,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_llama3_scaling_is_read(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "llama3-rope")
    assert load_hf(folder, progress=False).config.rope_scaling == RopeScaling(
        "llama3", 8.0, 1.0, 4.0, 64
    )


def test_tied_checkpoint_has_no_lm_head(tmp_path: Path) -> None:
    hf, folder = _saved(tmp_path, "llama-tied")
    checkpoint = load_hf(folder, progress=False)
    assert "lm_head.weight" not in checkpoint.state_dict
    assert checkpoint.build().lm_head is None
    sd = hf.state_dict()
    torch.testing.assert_close(
        checkpoint.state_dict["embed_tokens.weight"], sd["model.embed_tokens.weight"]
    )


def test_bf16_weights(tmp_path: Path) -> None:
    hf, folder = _saved(tmp_path, "llama")
    model = load_hf(folder, dtype="bf16", progress=False).build()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = random_ids(16)
    ours = our_logits(model, ids).float()
    reference = hf_logits(hf.to(torch.bfloat16), ids).float()
    # Both round every op to bf16 (8 mantissa bits); the kernels differ in accumulation order,
    # which oneDNN picks by shape and CPU (AMX or AVX512-BF16). Measured 0.059 on logits up to
    # ~4.2, where one bf16 ulp is 2^-5: the bound is about 3 ulps.
    assert (ours - reference).abs().max() < BF16_LOGIT_TOL
    # So the argmax can swap only where the reference's top two are within 2 x the bound (two
    # of the 16 positions here: 0.047 and 0.125 apart); everywhere else it must agree.
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * BF16_LOGIT_TOL
    assert clear.sum() >= 12
    assert torch.equal(ours.argmax(-1)[clear], reference.argmax(-1)[clear])


def test_generation_config_eos_is_merged(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_hf(folder, progress=False).config.eos_token_ids == (2, 7)


def test_transformers4_config_spelling() -> None:
    raw = {
        **TINY,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    config = read_hf_config(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("linear", 4.0)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"model_type": "gpt2"}, UnknownArchitectureError, "model_type 'gpt2' is not supported; "),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, CheckpointError, "'yarn'"),
        ({"quantization_config": {"quant_method": "awq"}}, CheckpointError, "quantization_co"),
        ({"num_key_value_heads": 3}, CheckpointError, "num_kv_heads"),
        ({"vocab_size": 0}, CheckpointError, "vocab_size"),
    ],
)
def test_bad_configs_raise(change: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        read_hf_config({**TINY, "model_type": "llama", **change})


@pytest.mark.parametrize(
    ("model_type", "missing"),
    [
        (None, "'model_type' is missing"),
        ("llama", "'num_attention_heads' is missing \\(model_type 'llama'\\)"),
        ("gemma3_text", "'num_attention_heads' is missing \\(model_type 'gemma3_text'\\)"),
        ("laguna", "'num_attention_heads' is missing"),
    ],
)
def test_missing_config_key_is_named(model_type: str | None, missing: str) -> None:
    raw = {k: v for k, v in TINY.items() if k != "num_attention_heads"}
    with pytest.raises(MissingFieldError, match=missing):
        read_hf_config({**raw, **({"model_type": model_type} if model_type else {})})


def test_unknown_architecture_folder_loads_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, folder = _saved(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    opened: list[str] = []
    monkeypatch.setattr("safetensors.safe_open", lambda path, **kw: opened.append(path))
    with pytest.raises(UnknownArchitectureError, match="'gpt_neox'"):
        load_hf(folder, progress=False)
    assert opened == []


def test_missing_folder_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_hf(missing)
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(missing)
