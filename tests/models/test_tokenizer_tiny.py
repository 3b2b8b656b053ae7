"""Tokenizer from a tiny GGUF written here: pre-tokenizer choice, BOS, added tokens, errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvabi.models import Tokenizer
from kvabi.models.tokenizer import _byte_alphabet

ALPHABET = list(_byte_alphabet())
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ in", "1 2", "12 3", "' s", "Ġ ĠĠ", "Ġ Ġ"]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["the theme in the", "It's 123 in  the   heat", "x 12345 y", "<s>a</s> <think>"]


def _vocab() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return ALPHABET + list(dict.fromkeys(merged)) + SPECIALS + ["<think>"]


def write_tokenizer_gguf(path: Path, pre: str, model: str = "gpt2", add_bos: bool = True) -> None:
    tokens = _vocab()
    types = [1] * (len(tokens) - 5) + [3, 3, 3, 3, 4]  # 3 control, 4 user-defined
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "llama-bpe")
    return path


def test_llama3_style_file_matches_transformers(tiny_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(tiny_gguf)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == hf.decode(
            hf.encode(text), skip_special_tokens=True
        )


def test_bos_merges_and_added_tokens(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_gguf)
    vocab = _vocab()
    bos, eos = vocab.index("<s>"), vocab.index("</s>")
    assert (tok.bos_token_id, tok.eos_token_ids) == (bos, (eos,))
    assert tok.encode(" the") == [bos, vocab.index("Ġthe")]
    assert tok.encode(" the", add_special_tokens=False) == [vocab.index("Ġthe")]
    assert tok.encode("<think>", add_special_tokens=False) == [vocab.index("<think>")]
    # llama3 split keeps up to 3 digits together: "123" then "45"
    assert tok.encode("12345", add_special_tokens=False) == [vocab.index("123"), ord("4"), ord("5")]


def test_chat_template_sees_special_tokens(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_gguf)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], True, tokenize=False)
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[:2] == [tok.bos_token_id, tok.token_id("<|im_start|>")]  # no second BOS


def test_smollm_splits_every_digit(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "smollm", add_bos=False)
    # byte b has id b here; the merges "1 2" and "12 3" never get a chance
    assert Tokenizer.from_gguf(path).encode("123") == [ord("1"), ord("2"), ord("3")]


@pytest.mark.parametrize(
    ("pre", "model", "message"),
    [
        ("falcon", "gpt2", "tokenizer.ggml.pre 'falcon' is not supported"),
        ("default", "llama", "tokenizer.ggml.model 'llama'"),
    ],
)
def test_unsupported_tokenizers_raise(tmp_path: Path, pre: str, model: str, message: str) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, pre, model)
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf(path)


def test_no_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    tok = Tokenizer(Backend(BPE()), {})
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
