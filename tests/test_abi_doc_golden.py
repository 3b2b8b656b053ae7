"""docs/ABI.md's own golden values, read out of the file and checked against the code.

The spec is what a third party implements a reader from, so its vectors must be the code's:
every canonical descriptor JSON and text form in it, the tables of 6.2 and 6.4, and the
`golden` blocks of 6.7 (descriptor, compat digest, groups, buffers, container bytes). Header
bytes, meta checksums and digests are also rebuilt independently (struct, hashlib, xxhash).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import xxhash

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.codec import GGML_BLOCK_BYTES
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.kv_groups import kv_groups
from kvabi.abi.layout import GGML_QUANTS
from kvabi.abi.text_form import from_text
from kvabi.wire import container_bytes
from tests.wire.container_cases import tiny
from tests.wire.test_container_windows import windowed

SPEC = (Path(__file__).parents[1] / "docs" / "ABI.md").read_text()
FENCES = re.findall(r"^```(\w*)\n(.*?)^```$", SPEC, re.S | re.M)
GOLDEN = [
    dict(line.split(": ", 1) for line in body.splitlines())
    for tag, body in FENCES
    if tag == "golden"
]
SPEC_JSONS = [body.strip() for _, body in FENCES if body.startswith('{"kvabi":"')]
SPEC_TEXTS = [body.strip() for _, body in FENCES if body.startswith("kvabi/1.") and "[" not in body]


def test_the_spec_has_its_vectors():
    names = {g["name"] for g in GOLDEN}
    assert {"tiles", "groups", "windows", "mla", "dsa", "tp", "per_token_head"} <= names
    assert len(SPEC_JSONS) >= 4 and len(SPEC_TEXTS) >= 2


@pytest.mark.parametrize("text", SPEC_JSONS)
def test_every_descriptor_json_in_the_spec_is_canonical_and_round_trips(text):
    assert Descriptor.from_json(text).to_json() == text
    assert json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")) == text


@pytest.mark.parametrize("text", SPEC_TEXTS)
def test_every_text_form_in_the_spec_round_trips(text):
    assert str(from_text(text)) == text


def _table_value(section: str, item: str) -> str:
    """The backticked value of row `item` of the table in section `section` of the spec."""
    body = SPEC.split(f"### {section}", 1)[1].split("\n### ", 1)[0]
    row = re.search(rf"^\| {re.escape(item)}\s*\|\s*`?([^`|]+?)`?\s*\|", body, re.M)
    assert row, (section, item)
    return row.group(1).strip()


def test_the_tiny_and_windowed_containers_of_6_2_and_6_4():
    _, _, data = tiny()
    assert data[:32].hex() == _table_value("6.2", "header, bytes 0..31")
    assert hashlib.sha256(data).hexdigest() == _table_value("6.2", "SHA-256 of the whole container")
    assert f"{len(data)} bytes" == _table_value("6.2", "total length")
    _, data = windowed()
    assert data[:32].hex() == _table_value("6.4", "header, bytes 0..31")
    assert hashlib.sha256(data).hexdigest() == _table_value("6.4", "SHA-256 of the container")
    assert f"{len(data)} bytes" == _table_value("6.4", "total length")


def _compat(model: dict) -> str:
    """Section 2.3, from the JSON alone."""
    body = {k: model[k] for k in ("fingerprint", "k_post_rope", "layers", "rope_dim")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _header(desc_json: str, num_tokens: int) -> bytes:
    """Section 5.2, from the JSON alone: flags iff a swa layer, a section per owner layer."""
    layers = json.loads(desc_json)["model"]["layers"]
    flags = int(any(x["kind"] == "swa" for x in layers))
    owners = sum(x["kind"] not in ("shared", "none") for x in layers)
    return struct.pack(
        "<8sHHIIIII", b"KVABI\x00\r\n", 1, flags, flags, len(desc_json), num_tokens, 0, owners
    )


@pytest.mark.parametrize("golden", GOLDEN, ids=[g["name"] for g in GOLDEN])
def test_golden_descriptor(golden):
    desc = from_text(golden["text"])
    assert str(desc) == golden["text"]
    assert desc.to_json() == golden["json"]
    assert Descriptor.from_json(golden["json"]) == desc
    assert (
        desc.model.compat_digest()
        == golden["compat"]
        == _compat(json.loads(golden["json"])["model"])
    )
    groups = " ".join("{" + ",".join(map(str, g.layer_ids)) + "}" for g in kv_groups(desc.model))
    assert groups == golden["groups"]


@pytest.mark.parametrize("golden", GOLDEN, ids=[g["name"] for g in GOLDEN])
def test_golden_container(golden):
    desc, num_tokens = from_text(golden["text"]), int(golden["tokens"])
    extent = -(-num_tokens // desc.layout.block_size) if desc.layout.is_paged else num_tokens
    shapes = " ".join(
        f"{s.key}={list(s.shape)}".replace(" ", "") for s in buffer_specs(desc, extent)
    )
    assert shapes == golden["buffers"]
    token_ids = list(range(1, num_tokens + 1))
    data = container_bytes(CacheBuffers.empty(desc, extent, "zeros"), token_ids)
    header = _header(golden["json"], num_tokens)
    assert data[:32].hex() == golden["header"] == header.hex()
    meta = header + golden["json"].encode() + struct.pack(f"<{num_tokens}I", *token_ids)
    (stored,) = struct.unpack_from("<Q", data, len(meta))
    assert hex(stored) == golden["meta_checksum"] == hex(xxhash.xxh3_64_intdigest(meta))
    assert len(data) == int(golden["length"])
    assert hashlib.sha256(data).hexdigest() == golden["sha256"]


def test_ggml_record_sizes_are_ggmls():
    """3.3's table of record sizes, against the gguf package's own GGML_QUANT_SIZES."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for quant in GGML_QUANTS:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[quant.upper()]]
        assert (block, size) == (32, GGML_BLOCK_BYTES[quant])
        assert re.search(rf"^\| `{quant}` \| `{size} W / 32`", SPEC, re.M), quant
