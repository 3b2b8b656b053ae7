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
