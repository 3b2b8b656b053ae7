"""Gemma 3 text (tiny random HF models, saved and loaded through kvabi): logits, incremental
decode and greedy continuations equal transformers', prompts longer than the window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.descriptor import ATTN, LayerSpec
from kvabi.models import Gemma3Model, load_hf
from kvabi.models.gemma3_config import read_gemma3_config
from tests.models.hf_reference import (
    FP32_LOGIT_TOL,
    assert_greedy_equal,
    assert_incremental_equal,
    assert_logits_equal,
    randomize,
    save_and_load,
)
from tests.models.tiny import hf_logits, our_logits, random_ids

transformers = pytest.importorskip("transformers")
S, F = "sliding_attention", "full_attention"
COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # HF's default layer pattern (here 5 sliding then 1 full) with window 4; a score scale
    # query_pre_attn_scalar ** -0.5 that is not head_dim ** -0.5; tied embeddings
    "default-pattern": {
        "num_hidden_layers": 6,
        "sliding_window": 4,
        "query_pre_attn_scalar": 24,
    },
    # explicit layer types, linear RoPE scaling on the full layers (as the 4B+ models), final
    # logit softcapping and an untied head
    "linear-softcap": {
        "num_hidden_layers": 3,
        "sliding_window": 5,
        "layer_types": [S, F, S],
        "rope_parameters": {
            S: {"rope_type": "default", "rope_theta": 100.0},
            F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        },
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": False,
    },
}


def make_hf(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**COMMON, **CONFIGS[variant])
    return randomize(transformers.Gemma3ForCausalLM(config))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = make_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    return hf, save_and_load(hf, folder)


def test_logits_equal_transformers(pair: Any) -> None:
    assert_logits_equal(*pair)


def test_incremental_decode_equals_transformers(pair: Any) -> None:
    assert_incremental_equal(*pair)


def test_greedy_equals_generate(pair: Any) -> None:
    assert_greedy_equal(*pair)


def test_kv_layers_give_sliding_layers_their_window(pair: Any) -> None:
    hf, model = pair
    assert isinstance(model, Gemma3Model)
    assert model.config.layer_types == tuple(hf.config.layer_types)
    window = hf.config.sliding_window
    assert model.config.kv_layers() == tuple(
        LayerSpec(ATTN, 2, 16, 16, window=window if t == S else 0) for t in hf.config.layer_types
    )


@torch.no_grad()
def test_bf16_runs_its_gemms_on_packed_weights_with_the_same_logits(pair: Any) -> None:
    import copy

    from kvabi.models.packed_linear import PackedLinear
    from kvabi.native.cpu_kernels import cpu_kernels

    plain = copy.deepcopy(pair[1]).to(torch.bfloat16)
    packed = copy.deepcopy(plain).fuse_projections(kernels=cpu_kernels())
    linears = [m for m in packed.modules() if type(m) is torch.nn.Linear]
    assert linears and all(isinstance(m.forward, PackedLinear) for m in linears)
    assert isinstance(packed.packed_logits, PackedLinear)
    assert packed.state_dict().keys() == plain.state_dict().keys()  # parameters untouched
    ids = torch.randint(0, COMMON["vocab_size"], (21,), generator=torch.Generator().manual_seed(3))
    want, got = our_logits(plain, ids).float(), our_logits(packed, ids).float()
    # another GEMM summation order in bf16: within a few bf16 ulps of the logits' scale
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # float32 models are left on F.linear (the reference tests compare them to HF)
    fp32 = copy.deepcopy(pair[1]).fuse_projections(kernels=cpu_kernels())
    assert fp32.packed_logits is None
    assert not any(
        isinstance(m.forward, PackedLinear) for m in fp32.modules() if type(m) is torch.nn.Linear
    )


def test_default_pattern_is_every_sixth_layer_full() -> None:
    raw = {**COMMON, "num_hidden_layers": 8, "sliding_window": 4, "model_type": "gemma3_text"}
    assert read_gemma3_config(raw).layer_types == (S, S, S, S, S, F, S, S)


def test_multimodal_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    """A `gemma3` folder (Gemma3ForConditionalGeneration, weights under model.language_model.,
    a vision tower beside): the text model alone, equal to HF's on text-only input."""
    text = transformers.Gemma3TextConfig(**COMMON, **CONFIGS["default-pattern"])
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        patch_size=4, image_size=8,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    hf = randomize(transformers.Gemma3ForConditionalGeneration(config))
    hf.save_pretrained(tmp_path)
    checkpoint = load_hf(tmp_path, progress=False)
    assert not any(name.startswith(("vision", "multi_modal")) for name in checkpoint.state_dict)
    ids = random_ids(24)
    torch.testing.assert_close(
        our_logits(checkpoint.build(), ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type 'yarn'"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"layer_types": [S, F]}, "layer_types"),
    ],
)
def test_bad_configs_raise(change: dict[str, Any], message: str) -> None:
    raw = transformers.Gemma3TextConfig(**COMMON, **CONFIGS["default-pattern"]).to_dict()
    with pytest.raises(ValueError, match=message):
        read_gemma3_config({**raw, **change})


def write_gemma3_gguf(path: Path, hf: torch.nn.Module) -> None:
    """As llama.cpp's converter: gemma3.* keys, GGUF tensor names, norm weights stored w + 1."""
    import gguf

    from kvabi.models.gguf_loader import _GEMMA3_BLOCK_NAMES

    cfg, writer = hf.config, gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters[F]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    names |= {ours: kind for kind, ours in _GEMMA3_BLOCK_NAMES.items()}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        target = names[".".join(parts)] if parts[0] != "layers" else (
            f"blk.{parts[1]}.{names['.'.join(parts[2:])]}"
        )  # fmt: skip
        array = tensor.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(f"{target}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_a_tiny_model_equals_transformers(tmp_path: Path) -> None:
    """Without the bundled file: a tiny Gemma 3 written as llama.cpp would, read back equal."""
    from kvabi.models import load_gguf

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=16
    )
    hf = randomize(transformers.Gemma3ForCausalLM(config))
    write_gemma3_gguf(tmp_path / "tiny.gguf", hf)
    model = load_gguf(tmp_path / "tiny.gguf", progress=False).build()
    assert model.config.layer_types == tuple(hf.config.layer_types)
    ids = random_ids(24)
    torch.testing.assert_close(
        our_logits(model, ids), hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0
    )


def test_gguf_missing_field_names_it(tmp_path: Path) -> None:
    from kvabi.models import load_gguf

    hf = make_hf("default-pattern")
    write_gemma3_gguf(tmp_path / "tiny.gguf", hf)
    reader_bytes = (tmp_path / "tiny.gguf").read_bytes()
    assert b"gemma3.attention.sliding_window" in reader_bytes
    broken = reader_bytes.replace(
        b"gemma3.attention.sliding_window", b"gemma3.attention.sliding_wxndow"
    )
    (tmp_path / "broken.gguf").write_bytes(broken)
    with pytest.raises(ValueError, match="'gemma3.attention.sliding_window' is missing"):
        load_gguf(tmp_path / "broken.gguf", progress=False)


def test_hf_export_writes_a_gemma3_checkpoint_transformers_runs_bit_identically(
    pair: Any,
) -> None:
    """kvabi's Gemma 3 written back as an HF `Gemma3ForCausalLM` (what vLLM loads, since it
    cannot read a Gemma 3 GGUF): same config, and the original's logits to the bit."""
    from types import SimpleNamespace

    from kvabi.models.hf_export import hf_config, hf_state_dict

    hf, ours = pair
    raw = hf_config(ours.config, torch.float32)
    assert raw["model_type"] == "gemma3_text" and raw["architectures"] == ["Gemma3ForCausalLM"]
    config = transformers.Gemma3TextConfig(**raw)
    for name in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters",
                 "final_logit_softcapping", "tie_word_embeddings", "head_dim"):  # fmt: skip
        assert getattr(config, name) == getattr(hf.config, name), name
    again = transformers.Gemma3ForCausalLM(config)
    missing, unexpected = again.load_state_dict(
        hf_state_dict(SimpleNamespace(model=ours)), strict=False
    )
    assert not unexpected and missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    again.tie_weights()
    ids = random_ids(24)
    assert torch.equal(hf_logits(again.eval(), ids), hf_logits(hf, ids))
