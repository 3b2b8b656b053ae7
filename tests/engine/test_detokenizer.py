"""Detokenizer: the pieces, joined, are exactly the plain full decode, half characters held."""

from __future__ import annotations

import random

import pytest

from kvabi.engine.detokenizer import Detokenizer
from kvabi.models.tokenizer import Tokenizer
from tests.conftest import bundled_gguf_path
from tests.engine.tiny import EOS, tiny_tokenizer

TEXTS = [
    "Hello world, and again:  two spaces.\n\tTabbed line",
    "naïve café, Zürich — Ελληνικά, русский, 東京タワー, 한국어, العربية",
    "emoji 🚀🔥 a family 👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n東京🚀<|endoftext|> done",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_gguf_path())


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = Detokenizer()
    pieces = [detok.add(tokenizer, i) for i in ids]
    return [*pieces, detok.flush(tokenizer)]


def _check(tokenizer: Tokenizer, ids: list[int]) -> None:
    pieces = _pieces(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # half characters were held


def _with_specials(rng: random.Random, ids: list[int], specials: list[int]) -> list[int]:
    out = list(ids)
    for _ in range(max(len(ids) // 4, 1)):
        out.insert(rng.randrange(len(out) + 1), rng.choice(specials))
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_bundled_tokenizer_texts_with_specials_join_to_the_full_decode(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    _check(smollm2, ids)
    specials = sorted(smollm2.special_token_ids)
    _check(smollm2, _with_specials(random.Random(text), ids, specials))


def test_bundled_tokenizer_random_ids_join_to_the_full_decode(smollm2):
    # Random ids give split and invalid UTF-8 anywhere: U+FFFD mid-text, runs of byte tokens.
    rng = random.Random(0)
    byte_tokens = [smollm2.token_id(ch) for ch in "ĠðŁĺĢâĤ¬äæ"]  # bytes of multi-byte chars
    for _ in range(30):
        pick = [rng.random() < 0.4 for _ in range(60)]
        _check(smollm2, [rng.choice(byte_tokens) if b else rng.randrange(49152) for b in pick])


def test_a_character_split_over_byte_tokens_comes_out_whole_once_complete():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("a🚀b")  # byte-level, no merges: one token per byte
    assert len(ids) == 6
    assert _pieces(tokenizer, ids) == ["a", "", "", "", "🚀", "b", ""]


def test_tiny_tokenizer_random_bytes_and_eos_join_to_the_full_decode():
    tokenizer, rng = tiny_tokenizer(), random.Random(1)
    assert tokenizer.special_token_ids == {EOS}
    for _ in range(50):
        _check(tokenizer, [rng.choice([*range(256), EOS]) for _ in range(40)])


def test_flush_gives_a_trailing_half_character_as_the_full_decode_does():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("x🚀")[:3]  # "x" and two of the rocket's four bytes
    detok = Detokenizer()
    assert [detok.add(tokenizer, i) for i in ids] == ["x", "", ""]
    assert detok.flush(tokenizer) == tokenizer.decode(ids)[1:] and "\ufffd" in tokenizer.decode(ids)
