"""Text <-> token ids, and chat prompts, from a GGUF's metadata or an HF `tokenizer.json`.

The work is done by the `tokenizers` library. From GGUF, byte-level BPE
(`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen2), whose pre-tokenizer is picked by
`tokenizer.ggml.pre` to split text the way llama.cpp does for that vocabulary; and Gemma's
SentencePiece BPE (model "llama", arch gemma3), built as transformers' GGUF loader builds it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from kvabi.models.chat_template import DEFAULT_TEMPLATES, ChatTemplate
from kvabi.models.gguf_loader import metadata, open_gguf

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> regex split before byte-level; None: GPT-2's own byte-level regex.
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,  # plus single digits, as SmolLM's tokenizer.json and llama.cpp do
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPLIT_DIGITS = ("smollm",)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_GEMMA_ARCHS = ("gemma3",)  # SentencePiece files whose BPE is rebuilt from the vocabulary
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@cache
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table (index = byte value)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(extra)) for b in range(256))


@cache
def write_byte_level_tokenizer(folder: Path) -> None:
    """A tiny byte-level BPE for random-weight test and bench models (vocabulary 96): printable
    ASCII as ids 0..93, `<s>` 94, `</s>` 95, no merges; `tokenizer.json` and a
    `tokenizer_config.json` naming the specials and a BOS-only chat template."""
    vocab = {c: i for i, c in enumerate(_byte_alphabet()[33:127])}
    vocab |= {"<s>": 94, "</s>": 95}
    backend = Backend(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(Path(folder) / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": "{{ bos_token }}",
    }
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def _byte_alphabet_set() -> frozenset[str]:
    return frozenset(_byte_alphabet())


def _byte_level_spelling(token: str) -> str:
    """Tokens outside the byte alphabet (raw text in some files) respelled into it, as HF does."""
    alphabet = _byte_alphabet()
    if set(token) <= _byte_alphabet_set():
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported; "
            f"supported: {sorted(PRE_TOKENIZER_SPLITS)}"
        )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is not None:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated")]
        return pre_tokenizers.Sequence(
            [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in _SPLIT_DIGITS else []
    return pre_tokenizers.Sequence(
        [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def _gguf_backend(reader: GGUFReader) -> Backend:
    model = metadata(reader, "tokenizer.ggml.model")
    if model == "llama" and metadata(reader, "general.architecture") in _GEMMA_ARCHS:
        return _gemma_backend(reader)
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model {model!r}: only 'gpt2' (byte-level BPE) and Gemma's 'llama' "
            "are built from GGUF; load the HF folder with its tokenizer.json instead"
        )
    tokens = [_byte_level_spelling(t) for t in metadata(reader, "tokenizer.ggml.tokens")]
    merges = [tuple(m.split(" ")) for m in metadata(reader, "tokenizer.ggml.merges")]
    backend = Backend(
        BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    _add_marked_tokens(backend, tokens, metadata(reader, "tokenizer.ggml.token_type", []))
    return backend


def _gemma_spelling(token: str) -> str:
    """Gemma files store a token of two or more spaces as real spaces; the BPE spells them ▁."""
    return "\u2581" * len(token) if " " in token and not token.strip() else token


def _gemma_merges(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The file has no merges: every split of a token into two tokens is one, in file order
    (Gemma's scores do not follow its merge order), longer left part first. transformers'
    `generate_merges` with the file positions as scores gives the same list."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            if token[:cut] in vocab and token[cut:] in vocab:
                merges.append((token[:cut], token[cut:]))
    return merges


def _gemma_backend(reader: GGUFReader) -> Backend:
    """SentencePiece BPE with byte fallback: spaces become ▁ (no prefix space), split after each."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    vocab = {_gemma_spelling(t): i for i, t in enumerate(tokens)}
    unk = tokens[metadata(reader, "tokenizer.ggml.unknown_token_id")]
    backend = Backend(
        BPE(vocab=vocab, merges=_gemma_merges(vocab), unk_token=unk, fuse_unk=True,
            byte_fallback=True)
    )  # fmt: skip
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    types = metadata(reader, "tokenizer.ggml.token_type", [])
    _add_marked_tokens(backend, tokens, types, only_in=vocab)
    return backend


def _add_marked_tokens(
    backend: Backend,
    tokens: list[str],
    types: Sequence[int],
    only_in: Mapping[str, int] | None = None,
) -> None:
    """Control tokens become special, user-defined ones plain added tokens: both match whole.
    `only_in`: user-defined tokens spelled otherwise in this vocabulary are left to the model
    (as transformers: Gemma's runs of spaces, respelled ▁)."""
    if not types:
        return
    marked = list(zip(tokens, types, strict=True))
    if only_in is not None:
        marked = [(t, kind) for t, kind in marked if kind != _USER_DEFINED or t in only_in]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in marked if kind == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in marked if kind == _USER_DEFINED]
    )


def _bos_processor(bos: str, bos_id: int) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    return value.get("content") if isinstance(value, Mapping) else value


def _read_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


class Tokenizer:
    """encode/decode, special token ids and the chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = (
            None if chat_template is None else ChatTemplate(chat_template, self.special_tokens)
        )

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFReader) -> Tokenizer:
        reader = source if isinstance(source, GGUFReader) else open_gguf(source)
        backend = _gguf_backend(reader)
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        ids = {
            name: metadata(reader, f"tokenizer.ggml.{key}", None)
            for name, key in _SPECIAL_IDS.items()
        }
        special = {name: None if i is None else tokens[i] for name, i in ids.items()}
        bos_id = ids["bos_token"]
        if metadata(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            backend.post_processor = _bos_processor(tokens[bos_id], bos_id)
        template = metadata(reader, "tokenizer.chat_template", None)
        if template is None:
            template = DEFAULT_TEMPLATES.get(metadata(reader, "general.architecture", ""))
        return cls(backend, special, template)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """An HF folder: tokenizer.json, plus tokenizer_config.json / chat_template.jinja."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {folder}")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_IDS}
        return cls(Backend.from_file(str(path)), special, _read_chat_template(folder, config))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` leaves out."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.token_id(bos)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.special_tokens.get("eos_token")
        token_id = None if eos is None else self.token_id(eos)
        return () if token_id is None else (token_id,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """Like HF's: the rendered prompt, or its ids (the template writes its own specials)."""
        if self.chat_template is None:
            raise ValueError("chat_template: this tokenizer has none")
        text = self.chat_template.render(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
