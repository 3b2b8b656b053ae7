"""Block hash: golden vectors built by hand with struct, the chain property, salts, portability."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvabi.abi.block_hash import hash_block, hash_blocks, root_hash
from kvabi.abi.descriptor import LayerSpec, ModelSpec

DIGEST = "00112233445566778899aabbccddeeff"
EXTRAS = {"cache_salt": "tenant-a", "adapter": "lora-7"}
TAG = b"kvabi-block-hash/1"

# Pinned once from the hand-built inputs below; they are also in docs/ABI.md, section 6.
ROOT_PLAIN = "86da9ac1b639e1a755827486b34e2658ca48ca56bcc6717bbcf615d428b449df"
ROOT_SALTED = "544db9ab828e7ab8d66331dfd88bd35d1a56a94eb61cc6cb673068d843cfc36d"
BLOCK_0 = "d9abf63215bd5e0f08023aa3296f917b131d62f1020e8f382eb009d6f9cd7c10"
BLOCK_1 = "93a3a3e62a0e4854409697e23cee08ba4767bcbb292a0db1f8f03932092e8d9a"
GOLDEN_TOKENS = [1, 2, 3, 4, 5, 6, 7, 2**32 - 1, 9]  # two full blocks of 4 and one partial


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_root_golden_without_extras() -> None:
    expected = _sha(TAG + bytes.fromhex(DIGEST) + struct.pack("<I", 0))
    assert root_hash(DIGEST) == expected
    assert root_hash(DIGEST, {}) == expected
    assert expected.hex() == ROOT_PLAIN


def test_root_golden_with_extras_sorted_by_key() -> None:
    extras = (
        struct.pack("<I", 2)
        + struct.pack("<H", 7)
        + b"adapter"
        + struct.pack("<I", 6)
        + b"lora-7"
        + struct.pack("<H", 10)
        + b"cache_salt"
        + struct.pack("<I", 8)
        + b"tenant-a"
    )
    expected = _sha(TAG + bytes.fromhex(DIGEST) + extras)
    assert root_hash(DIGEST, EXTRAS) == expected
    assert expected.hex() == ROOT_SALTED


def test_block_chain_golden() -> None:
    root = bytes.fromhex(ROOT_PLAIN)
    h0 = _sha(root + struct.pack("<I", 4) + struct.pack("<4I", 1, 2, 3, 4))
    h1 = _sha(h0 + struct.pack("<I", 4) + struct.pack("<4I", 5, 6, 7, 2**32 - 1))
    assert (h0.hex(), h1.hex()) == (BLOCK_0, BLOCK_1)
    assert hash_blocks(GOLDEN_TOKENS, 4, root) == [h0, h1]
    assert hash_block(root, [1, 2, 3, 4]) == h0
    assert hash_block(h0, (5, 6, 7, 2**32 - 1)) == h1


def test_hash_block_of_a_partial_block_counts_its_tokens() -> None:
    root = bytes.fromhex(ROOT_PLAIN)
    assert hash_block(root, [9]) == _sha(root + struct.pack("<I", 1) + struct.pack("<I", 9))
    assert hash_block(root, []) == _sha(root + struct.pack("<I", 0))


def test_chain_prefix_property() -> None:
    root = root_hash(DIGEST)
    tokens = list(range(100, 137))  # 37 tokens: 9 full blocks of 4
    full = hash_blocks(tokens, 4, root)
    assert len(full) == 9
    for n in range(len(tokens) + 1):
        assert hash_blocks(tokens[:n], 4, root) == full[: n // 4]
    assert len(set(full)) == 9


def test_a_differing_token_changes_its_block_and_every_later_one() -> None:
    root = root_hash(DIGEST)
    tokens = list(range(16))
    changed = tokens.copy()
    changed[5] = 999
    a, b = hash_blocks(tokens, 4, root), hash_blocks(changed, 4, root)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_salt_and_model_change_every_hash() -> None:
    tokens = list(range(32))
    chains = [
        hash_blocks(tokens, 8, root_hash(DIGEST)),
        hash_blocks(tokens, 8, root_hash(DIGEST, {"cache_salt": "tenant-a"})),
        hash_blocks(tokens, 8, root_hash(DIGEST, {"cache_salt": "tenant-b"})),
        hash_blocks(tokens, 8, root_hash(DIGEST, EXTRAS)),
        hash_blocks(tokens, 8, root_hash("ff" * 16)),
    ]
    for i, a in enumerate(chains):
        for b in chains[i + 1 :]:
            assert all(x != y for x, y in zip(a, b, strict=True))


def test_root_binds_the_model_compat_digest() -> None:
    a = ModelSpec((LayerSpec("attn", 2, 16, 16),), fingerprint="m")
    b = ModelSpec((LayerSpec("attn", 2, 16, 16),), fingerprint="other")
    assert root_hash(a.compat_digest()) != root_hash(b.compat_digest())
    assert len(root_hash(a.compat_digest())) == 32


def test_accepts_numpy_and_torch_token_ids() -> None:
    import numpy as np
    import torch

    root = bytes.fromhex(ROOT_PLAIN)
    expected = [bytes.fromhex(BLOCK_0), bytes.fromhex(BLOCK_1)]
    assert hash_blocks(np.array(GOLDEN_TOKENS, dtype=np.uint32), 4, root) == expected
    assert hash_blocks(torch.tensor(GOLDEN_TOKENS, dtype=torch.int64), 4, root) == expected


@pytest.mark.parametrize("bad", [-1, 2**32, 2**70])
def test_token_ids_out_of_range(bad: int) -> None:
    root = root_hash(DIGEST)
    with pytest.raises(ValueError, match="token_ids"):
        hash_blocks([1, bad, 3, 4], 4, root)
    with pytest.raises(ValueError, match="token_ids"):
        hash_block(root, [bad])


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2, 3], block_size, root_hash(DIGEST))


def test_bad_digest_parent_and_extras() -> None:
    with pytest.raises(ValueError, match="compat_digest"):
        root_hash("abc")
    with pytest.raises(ValueError, match="compat_digest"):
        root_hash("zz" * 16)
    with pytest.raises(ValueError, match="compat_digest"):
        root_hash("00 11 22 33 44 55 66 77 88 99 aa bb cc dd ee ff")
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"short", [1])
    with pytest.raises(ValueError, match="root"):
        hash_blocks([1], 1, b"short")
    with pytest.raises(ValueError, match="extra_keys"):
        root_hash(DIGEST, {"cache_salt": 7})  # type: ignore[dict-item]


def test_identical_in_a_fresh_process_with_another_hash_seed() -> None:
    code = (
        "from kvabi.abi.block_hash import hash_blocks, root_hash; "
        f"r = root_hash({DIGEST!r}, {EXTRAS!r}); "
        "print(','.join(h.hex() for h in hash_blocks(list(range(40)), 8, r)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = hash_blocks(list(range(40)), 8, root_hash(DIGEST, EXTRAS))
    assert out.split(",") == [h.hex() for h in here]


def test_a_requests_root_is_the_one_salt_rule():
    from kvabi.abi.block_hash import request_root

    digest = "0123456789abcdef0123456789abcdef"
    assert request_root(digest) == request_root(digest, None) == root_hash(digest)
    assert request_root(digest, "t") == root_hash(digest, {"cache_salt": "t"}) != root_hash(digest)
    with pytest.raises(ValueError, match="^cache_salt: must be a non-empty string"):
        request_root(digest, "")  # before: its own tenant in the engine, none in the connector
