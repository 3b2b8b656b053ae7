"""The OpenAI request bodies the server accepts, as strict pydantic models.

Strict: a wrong JSON type is an error, never coerced (`"max_tokens": "5"` is refused). Unknown
fields are refused too, as OpenAI does, so a misspelt option never silently falls back to a
default. A few OpenAI fields that kvabi does not implement are accepted at their no-op value only.
kvabi extensions: `top_k`, `ignore_eos` (as vLLM), `cache_salt`, `session`, `tag`, `kv_press`
(a KV press at prefill, kvabi/engine/press.py: e.g. `"snapkv:ratio=0.75,question=24"`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvabi.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share: model, sampling and streaming."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 (vLLM's spelling): off
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # what a torch generator takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    session: str | None = None
    tag: str | None = None
    kv_press: str | None = None
    # OpenAI fields kvabi does not implement: accepted at the value that changes nothing.
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's `SamplingParams`; raises ValueError naming a field that is out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            n=self.n,
            stop=() if self.stop is None else self.stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            cache_salt=self.cache_salt,
            session=self.session,
            tag=self.tag,
            press=self.kv_press,
        )


class CompletionRequest(GenerationRequest):
    """/v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: Literal[False] = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (send a request per prompt)")
            self.prompt = self.prompt[0]
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: not supported (must be absent or equal to n)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The plain {role, content} dict a chat template renders (text parts joined)."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": "".join(p.text for p in self.content)}


class ChatRequest(GenerationRequest):
    """/v1/chat/completions: messages rendered through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        newer = self.max_completion_tokens
        return newer if newer is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's `logprobs`: None (off), 0 (the sampled token) or k alternatives."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs: true")
            return None
        return self.top_logprobs or 0
