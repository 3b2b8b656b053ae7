"""kvabi against LMCache 0.5.6's own EncodedKV codec (tests/interop/lmcache_oracle.py).

LMCache writes -> kvabi reads (same tensors) and writes back the same bytes; kvabi writes ->
LMCache decodes the same tensors and identity strings; the CLI does both through files.
"""

import json
from dataclasses import replace

import pytest
import torch

from kvabi.cli.main import main
from kvabi.interop.lmcache_blob import blob_bytes, parse_blob
from kvabi.interop.lmcache_buffers import blob_buffers, blob_from_buffers
from kvabi.wire import read_container
from tests.interop.lmcache_marks import LMCACHE_MARKS, run_oracle

pytestmark = LMCACHE_MARKS


@pytest.mark.parametrize("scope", ["per_tensor", "per_layer_head"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lmcache_blob_reads_and_writes_back_byte_exact(tmp_path, scope, dtype):
    run_oracle("encode", "7", scope, dtype, str(tmp_path / "lm"), cwd=tmp_path)
    data = (tmp_path / "lm.bin").read_bytes()
    ref = torch.load(tmp_path / "lm.pt")
    blob = parse_blob(data)
    assert blob_bytes(blob) == data  # every header field and string pair kept
    h = blob.header
    assert (h.layer_id, h.chunk_id, h.chunk_size, h.page_size) == (3, 1, 12, 4)
    assert h.ident("model_id") == "smollm2-135m" and h.ident("kv_layout") == "NHD"
    cache = blob_buffers(blob)
    assert torch.equal(cache.tensors["0.k"], ref["k"])  # K is stored as is
    assert torch.equal(cache.tensors["0.v"], ref["dv"])  # V dequantised as LMCache does
    if scope == "per_tensor":  # kvabi's writer re-quantises to LMCache's very payload
        again = blob_from_buffers(cache, 12, 0, dict(h.identity))
        again = replace(again, header=replace(again.header, layer_id=3, chunk_id=1,
                                              chunk_size=12, page_size=4))  # fmt: skip
        assert blob_bytes(again) == data


def test_kvabi_blob_decodes_in_lmcache(tmp_path):
    run_oracle("encode", "11", "per_tensor", "bfloat16", str(tmp_path / "lm"), cwd=tmp_path)
    cache = blob_buffers(parse_blob((tmp_path / "lm.bin").read_bytes()))
    g = torch.Generator().manual_seed(3)
    v = torch.randn(cache.tensors["0.v"].shape, generator=g).to(torch.bfloat16) * 5
    cache.tensors["0.v"].copy_(v)  # new V: kvabi quantises it itself
    ident = {"model_id": "kvabi-test", "rope_config_hash": "r1"}
    (tmp_path / "kv.bin").write_bytes(blob_bytes(blob_from_buffers(cache, 12, 0, ident)))
    run_oracle("decode", str(tmp_path / "kv.bin"), str(tmp_path / "kv.pt"), cwd=tmp_path)
    got = torch.load(tmp_path / "kv.pt")
    mine = blob_buffers(parse_blob((tmp_path / "kv.bin").read_bytes()))
    assert torch.equal(got["k"].reshape(12, 2, 8), cache.tensors["0.k"])
    assert torch.equal(got["v"].reshape(12, 2, 8), mine.tensors["0.v"])
    assert (got["v"].float().reshape(12, 2, 8) - v.float()).abs().max() < v.abs().max() / 8
    assert got["hashes"]["model_id"] == "kvabi-test" and got["hashes"]["kv_layout"] == ""
    assert got["hashes"]["rope_config_hash"] == "r1" and got["kv_head_count"] == 2


def test_cli_inspect_and_convert_both_ways(tmp_path, capsys):
    run_oracle("encode", "5", "per_tensor", "bfloat16", str(tmp_path / "lm"), cwd=tmp_path)
    blob_path = str(tmp_path / "lm.bin")
    assert main(["inspect", blob_path]) == 0
    out = capsys.readouterr().out
    assert "model_id='smollm2-135m'" in out and "kv_head_count 2" in out
    assert "checksums: ok" in out and "V torch.float8_e4m3fn" in out
    (tmp_path / "ids.json").write_text(json.dumps(list(range(100, 112))))
    kv = str(tmp_path / "a.kvabi")
    assert main(["convert", blob_path, kv, "--to", "vllm-flash-attn", "--block-size", "4",
                 "--tokens", str(tmp_path / "ids.json")]) == 0  # fmt: skip
    c = read_container(kv)
    assert list(c.token_ids) == list(range(100, 112)) and c.desc.layout.name == "vllm-flash-attn"
    back = str(tmp_path / "back.bin")
    assert main(["convert", kv, back, "--to", "lmcache-blob", "--model-id", "smollm2-135m"]) == 0
    run_oracle("decode", back, str(tmp_path / "back.pt"), cwd=tmp_path)
    ref, got = torch.load(tmp_path / "lm.pt"), torch.load(tmp_path / "back.pt")
    assert torch.equal(got["k"].reshape(12, 2, 8), ref["k"])
    assert torch.equal(got["v"].reshape(12, 2, 8), ref["dv"])
    assert (
        parse_blob((tmp_path / "back.bin").read_bytes()).payload
        == parse_blob((tmp_path / "lm.bin").read_bytes()).payload
    )
