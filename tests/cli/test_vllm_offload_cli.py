"""`kvabi inspect` / `kvabi convert` on vLLM offload folders: container -> offload -> container."""

import json

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.presets import preset_descriptor
from kvabi.cli.main import main
from kvabi.cli.peer_formats import detect_peer_format
from kvabi.cli.vllm_offload_cli import _model_spec
from kvabi.wire import read_container, write_container

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def model():
    return _model_spec("smollm2-135m-instruct")  # the bundled GGUF's geometry, HF's K order


def _container(path, model, n=40):
    desc = preset_descriptor("vllm-flash-attn", model, dtype="bf16")
    g = torch.Generator().manual_seed(0)
    tensors = {
        k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in allocate(desc, 3).items()
    }
    tokens = list(range(100, 100 + n))
    write_container(path, CacheBuffers(desc, tensors), tokens)
    return tokens


def test_container_to_offload_and_back(tmp_path, model, capsys):
    tokens = _container(tmp_path / "a.kvabi", model)
    out = tmp_path / "offload"
    args = ["convert", str(tmp_path / "a.kvabi"), str(out), "--to", "vllm-offload"]
    assert main([*args, "--model-name", MODEL_NAME]) == 0
    assert "2 files of 16 tokens (v1-nhd, packed)" in capsys.readouterr().out
    assert detect_peer_format(out).name == "vllm-offload"
    assert detect_peer_format(tmp_path / "a.kvabi") is None

    assert main(["inspect", str(out), "--model", "smollm2-135m-instruct"]) == 0
    shown = capsys.readouterr().out
    assert "model: HuggingFaceTB/SmolLM2-135M-Instruct  dtype: bfloat16  format: v1-nhd" in shown
    assert "files: 2  sizes: {368640: 2}" in shown  # 30 layers x 16 tok x 3 heads x 128 x 2 B
    assert "files of another size: 0" in shown

    (tmp_path / "ids.json").write_text(json.dumps(tokens))
    back = ["convert", str(out), str(tmp_path / "b.kvabi"), "--to", "vllm-flash-attn"]
    opts = ["--tokens", str(tmp_path / "ids.json"), "--model", "smollm2-135m-instruct"]
    assert main([*back, *opts]) == 0
    assert "2 files, 32 of 40 tokens" in capsys.readouterr().out
    a, b = read_container(tmp_path / "a.kvabi"), read_container(tmp_path / "b.kvabi")
    assert b.desc == a.desc and list(b.token_ids) == tokens[:32] and len(b.block_hashes) == 2
    assert all(
        torch.equal(b.cache.tensors[k][:, :2], a.cache.tensors[k][:, :2]) for k in a.cache.tensors
    )


def test_refusals_are_one_line_errors(tmp_path, model, capsys):
    _container(tmp_path / "a.kvabi", model)
    out = tmp_path / "offload"
    assert main(["convert", str(tmp_path / "a.kvabi"), str(out), "--to", "vllm-offload"]) == 1
    assert "needs --model-name" in capsys.readouterr().err
    main(["convert", str(tmp_path / "a.kvabi"), str(out), "--to", "vllm-offload",
          "--model-name", MODEL_NAME])  # fmt: skip
    assert main(["convert", str(out), str(tmp_path / "b.kvabi"), "--to", "vllm-flash-attn"]) == 1
    assert "--tokens and --model are needed" in capsys.readouterr().err
    victim = next(out.rglob("*.bin"))
    victim.write_bytes(victim.read_bytes()[:4096])
    assert main(["inspect", str(out), "--model", "smollm2-135m-instruct"]) == 1
    assert "files of another size: 1" in capsys.readouterr().out
    config = next(out.rglob("config.json"))
    config.write_text(config.read_text().replace("bfloat16", "float16"))
    assert main(["inspect", str(out)]) == 1
    assert "config.json hashes to" in capsys.readouterr().err
