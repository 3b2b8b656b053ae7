"""`Detokenizer`: a sequence's output ids -> text, a few tokens at a time.

Each new token decodes a small window (the tokens of the last settled piece, for context, then
those not yet settled) and the text past the context is new; so a token costs the same at any
output length (vLLM's and HF's "prefix_offset / read_offset" technique). Text ending in U+FFFD
(half a multi-byte character) is held until later bytes settle it; `flush` gives it as the full
decode spells it. Special tokens are dropped before decoding, as `skip_special_tokens=True` does,
so the pieces join to exactly `tokenizer.decode(output_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvabi.models.tokenizer import Tokenizer


@dataclass
class Detokenizer:
    window: list[int] = field(default_factory=list)  # context ids, then ids not yet settled
    num_context: int = 0  # leading ids of `window` whose text was handed out already
    context_text: str = ""  # what they decode to (alone)

    def add(self, tokenizer: Tokenizer, token_id: int) -> str:
        """The text this token settles ("" while it ends in half a character)."""
        if token_id in tokenizer.special_token_ids:
            return ""
        self.window.append(token_id)
        return self._settle(tokenizer, is_final=False)

    def flush(self, tokenizer: Tokenizer) -> str:
        """Whatever is still held back, half characters as U+FFFD (the output has ended)."""
        return self._settle(tokenizer, is_final=True)

    def _settle(self, tokenizer: Tokenizer, is_final: bool) -> str:
        text = tokenizer.decode(self.window, skip_special_tokens=True)
        if len(text) <= len(self.context_text) or (text.endswith("\ufffd") and not is_final):
            return ""
        new = text[len(self.context_text) :]
        self.window = self.window[self.num_context :]  # the settled piece: the next context
        self.num_context = len(self.window)
        self.context_text = tokenizer.decode(self.window, skip_special_tokens=True)
        return new
