import dataclasses

import pytest
import torch

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.catalog import catalog_model
from kvabi.abi.convert import read_planes
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.cli.main import main
from kvabi.wire import read_container, write_container


def _container(path, n=40):
    model = catalog_model("smollm2-135m")
    desc = preset_descriptor("vllm-flash-attn", model)
    g = torch.Generator().manual_seed(0)
    cache = CacheBuffers(
        desc,
        {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in allocate(desc, 3).items()},
    )
    tokens = list(range(100, 100 + n))
    hashes = hash_blocks(tokens, 16, root_hash(model.compat_digest()))
    write_container(path, cache, tokens, hashes)
    return cache, tokens, hashes


def test_layouts_lists_every_preset(capsys):
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)


def test_plan_llama3_70b_is_10_7_gb_per_32k_request(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "10737418240" in out and "327680" in out


def test_plan_deepseek_v3_defaults_to_vllm_mla_and_keeps_fp8_records_dtype(capsys):
    """An MLA model plans in vllm-mla (576 bf16 values = 1,152 B per token per layer, 61 layers);
    the fp8_ds_mla preset keeps its u8 records (656 B) unless --dtype says otherwise."""
    assert main(["plan", "--model", "deepseek-v3", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "name=vllm-mla" in out and f"{61 * 1152 * 131072}" in out
    argv = ["plan", "--model", "deepseek-v3", "--context", "131072", "--layout", "vllm-fp8-ds-mla"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dtype=u8 quant=fp8_ds_mla" in out and f"{61 * 656 * 131072}" in out


def test_inspect_and_convert_round_trip(tmp_path, capsys):
    cache, tokens, hashes = _container(tmp_path / "a.kvabi")
    assert main(["inspect", str(tmp_path / "a.kvabi")]) == 0
    out = capsys.readouterr().out
    assert "tokens: 40" in out and "block hashes: 2" in out and "checksums: ok" in out
    assert (
        main(
            [
                "convert",
                str(tmp_path / "a.kvabi"),
                str(tmp_path / "b.kvabi"),
                "--to",
                "llamacpp-f16-vtrans",
                "--dtype",
                "f32",
            ]
        )
        == 0
    )
    b = read_container(tmp_path / "b.kvabi")
    assert b.desc.layout.name == "llamacpp-f16-vtrans" and b.desc.layout.v_axes == "HCT"
    assert list(b.token_ids) == tokens and list(b.block_hashes) == hashes
    for layer in (0, 29):
        got, want = read_planes(b.cache, layer, 40), read_planes(cache, layer, 40)
        assert all(torch.equal(got[p], want[p]) for p in "kv")


def test_inspect_refuses_a_corrupt_file(tmp_path, capsys):
    _container(tmp_path / "a.kvabi")
    raw = bytearray((tmp_path / "a.kvabi").read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (tmp_path / "bad.kvabi").write_bytes(bytes(raw))
    assert main(["inspect", str(tmp_path / "bad.kvabi")]) == 1
    assert "checksum" in capsys.readouterr().err.lower()


def test_convert_refuses_a_cross_layer_target(tmp_path, capsys):
    _container(tmp_path / "a.kvabi")
    assert (
        main(["convert", str(tmp_path / "a.kvabi"), str(tmp_path / "b.kvabi"), "--to", "trtllm"])
        == 1
    )
    assert "cross-layer" in capsys.readouterr().err
    assert not (tmp_path / "b.kvabi").exists()


def test_convert_refuses_block_sizes_past_the_tokens_held_in_one_line(tmp_path, capsys):
    # Before: 1073741824 tried an 824 GB allocation (a 29-line traceback); 16384 wrote 377 MB.
    _container(tmp_path / "a.kvabi")  # 40 tokens
    out = tmp_path / "b.kvabi"
    for size in ("1073741824", "16384", "0"):
        args = ["convert", str(tmp_path / "a.kvabi"), str(out), "--to", "vllm-flash-attn"]
        assert main([*args, "--block-size", size]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--block-size {size}: must be in [1, 1024]" in err
        assert not out.exists()
    assert main([*args, "--block-size", "64"]) == 0  # one padded block is fine
    assert read_container(out).desc.layout.block_size == 64


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, capsys):
    # A writer that recomputed the checksums over bad token ids: checksums alone pass.
    model = catalog_model("smollm2-135m")  # the fingerprint names a catalog model: vocab 49152
    desc = preset_descriptor("vllm-flash-attn", model)
    tokens = [1, 2, 49152, 3]
    write_container(tmp_path / "bad.kvabi", CacheBuffers(desc, allocate(desc, 1)), tokens)
    for command in (["inspect"], ["convert", "--to", "vllm-flash-attn-hnd"]):
        args = [*command[:1], str(tmp_path / "bad.kvabi"), *command[1:]]
        if command[0] == "convert":
            args.insert(2, str(tmp_path / "out.kvabi"))
        assert main(args) == 1
        assert "token id 49152 at position 2 is outside the model's vocabulary" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "out.kvabi").exists()


def test_inspect_checks_token_ids_against_a_given_model(tmp_path, capsys):
    from kvabi.interop.model_spec import state_dict_fingerprint
    from kvabi.models.registry import load_model
    from tests.server.tiny_server import tiny_folder

    folder = tiny_folder(tmp_path / "tiny")
    fingerprint = state_dict_fingerprint(load_model(folder, progress=False).model.state_dict())
    spec = dataclasses.replace(catalog_model("smollm2-135m"), fingerprint=fingerprint)
    desc = preset_descriptor("vllm-flash-attn", spec)
    for name, tokens in (("ok", [1, 2, 256]), ("bad", [1, 2, 257])):  # the tiny vocab: 257
        write_container(tmp_path / f"{name}.kvabi", CacheBuffers(desc, allocate(desc, 1)), tokens)
    assert main(["inspect", str(tmp_path / "ok.kvabi"), "--model", str(folder)]) == 0
    assert main(["inspect", str(tmp_path / "bad.kvabi"), "--model", str(folder)]) == 1
    assert "token id 257 at position 2" in capsys.readouterr().err
    other = tmp_path / "a.kvabi"
    _container(other)  # fingerprint smollm2-135m: another model than the folder's
    assert main(["inspect", str(other), "--model", str(folder)]) == 1
    assert "its cache is of another model" in capsys.readouterr().err


def test_plan_of_an_hf_folder_prints_groups_and_each_groups_attention_paths(tmp_path, capsys):
    """A hybrid model read from its folder (config only): one row per KV group (sliding, full,
    shared readers), and per group the paths the engine's predicates give on this machine."""
    pytest.importorskip("transformers")
    from kvabi.abi.descriptor import ModelSpec
    from kvabi.abi.presets import preset_descriptor
    from kvabi.engine.attention_plan import attention_paths
    from kvabi.models.registry import query_heads, read_model_config
    from tests.models.test_gemma4 import make_hf

    make_hf("shared-kv").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "model: HF folder, 6 layers" in out and "window 4" in out
    config = read_model_config(tmp_path)
    desc = preset_descriptor("vllm-flash-attn", ModelSpec(config.kv_layers(), tmp_path.name))
    rows = attention_paths(desc, query_heads(config))
    assert any(r.readers for r in rows) and any(r.group.window for r in rows)
    for r in rows:
        assert str(r.prefill) in out and str(r.decode) in out
    assert "torch SDPA: sliding window 4" in out  # the sliding groups' decode, on any CPU


def test_plan_refuses_the_model_twice(capsys):
    assert main(["plan", "llama-3-8b", "--model", "llama-3-8b"]) != 0
    assert "give the model once" in capsys.readouterr().err
