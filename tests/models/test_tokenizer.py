"""Tokenizer built from the bundled GGUF's metadata against transformers' tokenizer for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvabi.models import Tokenizer
from kvabi.models.registry import bundled_model_path

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " ",
    "   leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "naïve café, Zürich, São Paulo — Ελληνικά, русский, 東京, 한국어, العربية",
    "emoji 🚀🔥 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x != 0: pass",
    'print("{} {}".format(a, b)); x = [1, 2, 3]; y = {"k": None}',
    "numbers 3.14159, 1,000,000 and 2024-06-01",
    "don't I'M you'll we've they'D it's",
    "non\u00a0breaking and zero\u200bwidth",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> is special but <|notatoken|> is not",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]
# Non-ASCII numerals: SmolLM2's own tokenizer.json and llama.cpp's "smollm" pre-tokenizer isolate
# every \p{N} code point before the GPT-2 split; transformers' GGUF path (5.24) skips that step,
# which shows where a space precedes a non-ASCII numeral.
UNICODE_NUMERALS = [
    "x² + y³ = z²",
    "١٢٣ and ۴۵۶",
    "Ⅻ o'clock, ½ cup, ⑦ items",
    "10²³ and ²³",
    " ١٢٣",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3 — in Français, please. 🚀"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def hf() -> object:
    path = bundled_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours: Tokenizer, hf: object, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", UNICODE_NUMERALS)
def test_unicode_numerals_split_like_smollm2(ours: Tokenizer, hf: object, text: str) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    original = Backend.from_str(hf.backend_tokenizer.to_str())  # same vocab and merges
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    ids = ours.encode(text)
    assert ids == original.encode(text).ids
    assert ours.decode(ids) == text


def test_the_unicode_numeral_difference_is_real(ours: Tokenizer, hf: object) -> None:
    # The space before a numeral stays its own token, as before ASCII digits ("Ġ", "1", ...).
    assert ours.encode(" ²³") == [216, 19133, 39050]
    assert hf.encode(" ²³") == [3351, 127, 39050]


def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    assert ours.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf: object, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, **kwargs)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def test_tokenizer_json_folder_round_trip(ours: Tokenizer, hf: object, tmp_path: Path) -> None:
    """HF's save_pretrained of the same tokenizer reloads into ours with equal behaviour."""
    hf.save_pretrained(tmp_path)
    from_folder = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert from_folder.encode(text) == ours.encode(text)
    assert from_folder.eos_token_ids == ours.eos_token_ids
    assert from_folder.apply_chat_template(CONVERSATIONS[1], tokenize=False) == (
        ours.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    )
