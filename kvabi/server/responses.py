"""OpenAI response objects for completions and chat: the whole body, or a stream's chunks.

Both take `CompletionOutput`s (a stream's are the engine's deltas, a body's the whole choices),
so the stream and the body say the same thing. Token strings in logprobs are each token decoded
alone (a token holding part of a multi-byte character decodes to U+FFFD).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvabi.engine.outputs import CompletionOutput, RequestOutput
from kvabi.engine.sequence import TokenLogprob
from kvabi.models.tokenizer import Tokenizer


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    """Token counts: completion_tokens sums every choice's generated tokens."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


class Responses:
    """One request's response objects; subclasses say how a choice is spelt."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streamed response to a finished request."""
        choices = [self.choice(c, streamed=False) for c in out.outputs]
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        return self._envelope(
            self.object_name, choices, usage=usage(len(out.prompt_token_ids), num_completion)
        )

    def chunk(self, deltas: tuple[CompletionOutput, ...], include_usage: bool) -> dict[str, Any]:
        extra = {"usage": None} if include_usage else {}
        choices = [self.choice(d, streamed=True) for d in deltas]
        return self._envelope(self.chunk_object_name, choices, **extra)

    def opening_chunks(self, n: int, include_usage: bool) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat: the assistant role of each choice)."""
        return []

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return self._envelope(self.chunk_object_name, [], usage=usage(num_prompt, num_completion))

    def choice(self, d: CompletionOutput, streamed: bool) -> dict[str, Any]:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class CompletionResponses(Responses):
    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        super().__init__(model, tokenizer)
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next logprobs token

    def choice(self, d: CompletionOutput, streamed: bool) -> dict[str, Any]:
        logprobs = None if d.logprobs is None else self._logprobs(d.index, d.logprobs)
        return {
            "index": d.index,
            "text": d.text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
        }

    def _logprobs(self, index: int, entries: tuple[TokenLogprob, ...]) -> dict[str, list]:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets, at = [], self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top(e) for e in entries],
            "text_offset": offsets,
        }

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """Alternatives by token text; where two decode alike (U+FFFD), the likelier one stays."""
        top: dict[str, float] = {}
        for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1]):
            top.setdefault(self.token_text(token_id), logprob)
        return top


class ChatResponses(Responses):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, d: CompletionOutput, streamed: bool) -> dict[str, Any]:
        logprobs = None if d.logprobs is None else {"content": self._logprobs(d.logprobs)}
        if streamed:
            message = {"delta": {"content": d.text} if d.text else {}}
        else:
            message = {"message": {"role": "assistant", "content": d.text}}
        return {"index": d.index, **message, "logprobs": logprobs, "finish_reason": d.finish_reason}

    def opening_chunks(self, n: int, include_usage: bool) -> list[dict[str, Any]]:
        extra = {"usage": None} if include_usage else {}
        choices = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(n)
        ]
        return [self._envelope(self.chunk_object_name, choices, **extra)]

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        return [
            {
                **self._token(e.token_id, e.logprob),
                "top_logprobs": [self._token(t, lp) for t, lp in e.top.items()],
            }
            for e in entries
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
