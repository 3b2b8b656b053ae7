"""Block-hash schemes: kvabi's golden vectors through the registry, vLLM's own
`hash_block_tokens` and `Request` block hasher as the oracle (a subprocess in .venv-vllm),
llm-d's golden key from its own test, SGLang's definition, canonical CBOR against cbor2."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvabi.abi import cbor
from kvabi.abi.errors import CodecError, HashSchemeError
from kvabi.abi.hash_schemes import SCHEMES, RootInputs, get_scheme
from kvabi.connectors.vllm_handoff import VLLM_PYTHON
from tests.interop.vllm_marks import VLLM_MARKS

ORACLE = Path(__file__).with_name("vllm_hash_oracle.py")
DIGEST = "00112233445566778899aabbccddeeff"  # docs/ABI.md section 6's golden vectors
TOKENS = [1, 2, 3, 4, 5, 6, 7, 2**32 - 1, 9]
LORA = ("lora", "my-lora", "/tmp/lora")  # vLLM's (tag, lora_name, lora_path) extra key

# (algo, seed, block_size, token_ids, extra keys per block): what vLLM and kvabi both hash.
CHAINS: list[tuple[str, str | None, int, list[int], list[Any] | None]] = [
    ("sha256_cbor", None, 4, TOKENS, None),
    ("sha256_cbor", None, 1, [0, 1, 2**32 - 1], None),
    ("sha256_cbor", None, 16, list(range(1000, 1040)), None),
    ("sha256_cbor", "0", 3, list(range(10)), None),
    ("sha256_cbor", "", 4, TOKENS, None),  # llm-d's default seed
    ("sha256_cbor", None, 2, [5, 6, 7, 8], [(("cache_salt", "tenant-a"),), None]),
    ("sha256_cbor", None, 2, [5, 6, 7, 8], [(LORA,), (LORA, ("prompt_embeds", b"\x01\xff"))]),
    ("sha256_cbor", None, 2, [5, 6, 7, 8], [(("mm", "img-0", 3),), (("mm", "img-0", 1),)]),
    ("sha256", None, 4, TOKENS, None),
    ("sha256", "42", 2, [5, 6, 7, 8], [(LORA,), (("cache_salt", "s"),)]),
]
REQUESTS = [(None, None), ("tenant-a", None), (None, ["my-lora", 1, "/tmp/lora"])]
SCHEME_OF = {"sha256_cbor": "vllm-sha256-cbor", "sha256": "vllm-sha256"}


def _tag(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if isinstance(value, tuple):
        return {"t": [_tag(v) for v in value]}
    if isinstance(value, dict):
        return {"m": [[_tag(k), _tag(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    return value


CBOR_VALUES: list[Any] = [0, 23, 24, 255, 256, 2**32, 2**64 - 1, -1, -24, -25, -(2**64)]
CBOR_VALUES += [b"", b"\x00" * 300, "", "héllo ✓", [], (1, [2, (3,)]), None, True, False]
CBOR_VALUES += [{"bb": 1, "a": 2, 10: 3, "c": {"z": None}}, [b"\x09" * 32, list(range(30)), None]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM is not installed: scripts/setup_vllm.sh creates .venv-vllm")
    jobs: list[dict[str, Any]] = [
        {"op": "chain", "algo": a, "seed": s, "block_size": bs, "token_ids": ids,
         "extra_keys": _tag(ex)}
        for a, s, bs, ids, ex in CHAINS
    ]  # fmt: skip
    jobs += [
        {"op": "request", "algo": "sha256_cbor", "seed": None, "block_size": 4,
         "token_ids": TOKENS, "cache_salt": salt, "lora": lora}
        for salt, lora in REQUESTS
    ]  # fmt: skip
    jobs.append({"op": "cbor", "values": [_tag(v) for v in CBOR_VALUES]})
    tmp = tmp_path_factory.mktemp("vllm-hash")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(VLLM_PYTHON), str(ORACLE), str(tmp / "jobs.json"), str(tmp / "out.json")]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("case", range(len(CHAINS)))
@pytest.mark.parametrize("_mark", [pytest.param(0, marks=VLLM_MARKS)])
def test_vllm_chains_equal_vllms_own(oracle: list[list[str]], case: int, _mark: int) -> None:
    algo, seed, block_size, ids, extras = CHAINS[case]
    scheme = get_scheme(SCHEME_OF[algo])
    root = scheme.root(RootInputs(seed=seed))
    hashes = scheme.hash_blocks(ids, block_size, root, extras)
    assert [root.hex()] + [h.hex() for h in hashes] == oracle[case]
    assert len(hashes) == len(ids) // block_size > 0


@pytest.mark.parametrize("case", range(len(REQUESTS)))
@pytest.mark.parametrize("_mark", [pytest.param(0, marks=VLLM_MARKS)])
def test_vllm_request_hasher_extra_keys(oracle: list[list[str]], case: int, _mark: int) -> None:
    """vLLM makes the extra keys itself (LoRA on every block, cache_salt on block 0)."""
    salt, lora = REQUESTS[case]
    per_block = [[] for _ in range(len(TOKENS) // 4)]
    for keys in per_block:
        if lora:
            keys.append(("lora", lora[0], lora[2]))
    if salt:
        per_block[0].append(("cache_salt", salt))
    extras = [tuple(k) or None for k in per_block]
    scheme = get_scheme("vllm-sha256-cbor")
    hashes = scheme.hash_blocks(TOKENS, 4, scheme.root(), extras)
    assert [scheme.root().hex()] + [h.hex() for h in hashes] == oracle[len(CHAINS) + case]


@pytest.mark.parametrize("_mark", [pytest.param(0, marks=VLLM_MARKS)])
def test_cbor_equals_cbor2_canonical(oracle: list[list[str]], _mark: int) -> None:
    assert [cbor.dumps(v).hex() for v in CBOR_VALUES] == oracle[-1]


@pytest.mark.parametrize("_mark", [pytest.param(0, marks=VLLM_MARKS)])
def test_llmd_sha256_keys_are_vllms_last_8_bytes(oracle: list[list[str]], _mark: int) -> None:
    scheme = get_scheme("llm-d-sha256-cbor-64")  # seed "" (llm-d's default): CHAINS[4]
    hashes = scheme.hash_blocks(TOKENS, 4, scheme.root())
    assert [h.hex() for h in hashes] == oracle[4][1:]
    keys = [scheme.event_key(h) for h in hashes]
    assert keys == [bytes.fromhex(h)[24:] for h in oracle[4][1:]]
    assert all(len(k) == 8 for k in keys)


def test_kvabi_scheme_is_abi_section_4() -> None:
    scheme = get_scheme("kvabi")
    root = scheme.root(RootInputs(compat_digest=DIGEST))
    assert root.hex() == "86da9ac1b639e1a755827486b34e2658ca48ca56bcc6717bbcf615d428b449df"
    assert [h.hex() for h in scheme.hash_blocks(TOKENS, 4, root)] == [
        "d9abf63215bd5e0f08023aa3296f917b131d62f1020e8f382eb009d6f9cd7c10",
        "93a3a3e62a0e4854409697e23cee08ba4767bcbb292a0db1f8f03932092e8d9a",
    ]
    salted = scheme.root(RootInputs(compat_digest=DIGEST, cache_salt="tenant-a"))
    assert salted != root and scheme.event_key(root) == root


def test_llmd_fnv_golden_from_llmds_own_test() -> None:
    """llm-d/llm-d-kv-cache tests/e2e/uds_tokenizer/uds_e2e_test.go (commit 5fe37c8,
    `goldenRequestKeys`) with uds_e2e_suite_test.go's config: default seed "", block size 4,
    model ibm-granite/granite-3.1-8b-instruct, the 7 tokens of its golden prompt."""
    scheme = get_scheme("llm-d-fnv64a")
    root = scheme.root(RootInputs(model_name="ibm-granite/granite-3.1-8b-instruct"))
    ids = [8197, 438, 322, 18926, 432, 45600, 49]
    keys = [int.from_bytes(scheme.event_key(h), "big") for h in scheme.hash_blocks(ids, 4, root)]
    assert keys == [1334984470577408192]
    other = scheme.root(RootInputs(model_name="another-model"))
    assert scheme.hash_blocks(ids, 4, other) != scheme.hash_blocks(ids, 4, root)


def test_sglang_from_its_definition() -> None:
    """No golden in SGLang's tests: built from `get_hash_str` (python/sglang/srt/mem_cache/
    hicache_storage.py) as its source defines it, hex prior in, hex digest out."""

    def get_hash_str(token_ids: list[int], prior_hash: str | None) -> str:
        data = bytes.fromhex(prior_hash) if prior_hash else b""
        data += b"".join(t.to_bytes(4, "little") for t in token_ids)
        return hashlib.sha256(data).hexdigest()

    first = get_hash_str([1, 2, 3, 4], None)
    expected = [first, get_hash_str([5, 6, 7, 2**32 - 1], first)]
    scheme = get_scheme("sglang-sha256")
    assert [h.hex() for h in scheme.hash_blocks(TOKENS, 4, scheme.root())] == expected
    assert first == hashlib.sha256(bytes.fromhex("01000000020000000300000004000000")).hexdigest()


def test_every_scheme_chains() -> None:
    for name, scheme in SCHEMES.items():
        inputs = RootInputs(compat_digest=DIGEST)
        root = scheme.root(inputs)
        hashes = scheme.hash_blocks(TOKENS, 2, root)
        assert len(hashes) == 4 and len(set(hashes)) == 4, name
        assert all(len(h) == scheme.hash_bytes for h in hashes), name
        assert scheme.hash_block(hashes[0], TOKENS[2:4]) == hashes[1], name
        assert scheme.hash_blocks(TOKENS[:4], 2, root) == hashes[:2], name  # prefix property


def test_unknown_scheme_name() -> None:
    with pytest.raises(HashSchemeError, match="unknown block-hash scheme 'vllm-xxhash'"):
        get_scheme("vllm-xxhash")


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("bad", [-1, 2**32, "7", 1.5])
def test_bad_token_id(name: str, bad: object) -> None:
    scheme = get_scheme(name)
    root = scheme.root(RootInputs(compat_digest=DIGEST))
    with pytest.raises(HashSchemeError, match="token_ids"):
        scheme.hash_blocks([1, bad, 3], 1, root)  # type: ignore[list-item]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_wrong_parent_length(name: str) -> None:
    scheme = get_scheme(name)
    with pytest.raises(HashSchemeError, match=f"must be {scheme.hash_bytes} bytes"):
        scheme.hash_block(b"\x00" * (scheme.hash_bytes + 1), [1, 2])
    with pytest.raises(HashSchemeError, match="root"):
        scheme.hash_blocks([1, 2], 1, b"\x00" * 7)


def test_extra_keys_refused_where_a_scheme_cannot_encode_them() -> None:
    kvabi = get_scheme("kvabi")
    root = kvabi.root(RootInputs(compat_digest=DIGEST))
    with pytest.raises(HashSchemeError, match="root"):
        kvabi.hash_block(root, [1], (("cache_salt", "x"),))
    with pytest.raises(HashSchemeError, match="no extra keys"):
        get_scheme("sglang-sha256").hash_block(b"", [1], ("x",))
    with pytest.raises(HashSchemeError, match="float"):
        get_scheme("vllm-sha256-cbor").hash_block(b"\x00" * 32, [1], (1.5,))
    with pytest.raises(HashSchemeError, match="2 entries for 1 blocks"):
        get_scheme("vllm-sha256-cbor").hash_blocks([1, 2], 2, b"\x00" * 32, [None, None])
    with pytest.raises(HashSchemeError, match="compat_digest"):
        kvabi.root()


def test_cbor_refuses_what_it_cannot_encode_canonically() -> None:
    for bad in (1.0, 2**64, -(2**64) - 1, {1, 2}, object()):
        with pytest.raises(CodecError):
            cbor.dumps(bad)
