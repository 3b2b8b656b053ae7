"""A request's prompt as token ids and its `SamplingParams`, checked before any work is queued.

The context window (`engine.info.max_model_len`) bounds prompt + max_tokens: a prompt that fills
it, or an explicit max_tokens that overruns it, is a 400 `context_length_exceeded`; so is a
max_tokens the whole KV cache could not hold (`engine.max_kv_tokens`). An unset max_tokens
takes what both leave (completions: at most OpenAI's default of 16).
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from kvabi.engine.engine import LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.server.errors import bad_request, from_value_error
from kvabi.server.protocol import ChatRequest, CompletionRequest, GenerationRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams


def prepare_completion(req: CompletionRequest, engine: LLMEngine) -> PreparedRequest:
    """/v1/completions: text is tokenized (with the model's BOS rule); ids are taken as given."""
    prompt = req.prompt
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set:
        max_tokens = max(min(COMPLETION_DEFAULT_MAX_TOKENS, _room(engine, len(ids))), 1)
    return _prepare(req, ids, max_tokens, req.logprobs, engine, "prompt")


def prepare_chat(req: ChatRequest, engine: LLMEngine) -> PreparedRequest:
    """/v1/chat/completions: the messages through the model's chat template (generation prompt)."""
    if engine.tokenizer.chat_template is None:
        raise bad_request("messages: this model has no chat template; use /v1/completions")
    try:
        logprobs = req.num_logprobs
        messages = [m.as_template_message() for m in req.messages]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from exc
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return _prepare(req, list(ids), req.requested_max_tokens, logprobs, engine, "messages")


def _prepare(
    req: GenerationRequest,
    ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    engine: LLMEngine,
    prompt_field: str,
) -> PreparedRequest:
    _check_window(len(ids), max_tokens, engine.info.max_model_len, prompt_field)
    try:
        if max_tokens is None:
            max_tokens = max(_room(engine, len(ids)), 1)
        params = req.sampling_params(max_tokens, logprobs)
        prompt_ids = engine.prompt_ids(ids)
        engine.check_fits(len(ids), max_tokens)
        if params.press is not None:
            engine.check_press(len(ids), params)
    except ValueError as exc:
        raise from_value_error(exc, {"prompt": prompt_field}) from exc
    return PreparedRequest(prompt_ids, params)


def _room(engine: LLMEngine, num_prompt: int) -> int:
    """The most tokens a prompt leaves to generate: in the window and in the KV cache."""
    return min(engine.info.max_model_len, engine.max_kv_tokens + 1) - num_prompt


def _check_window(num_prompt: int, max_tokens: int | None, window: int, prompt_field: str) -> None:
    if num_prompt >= window:
        raise bad_request(
            f"{prompt_field}: {num_prompt} tokens; this model's context window is {window} "
            f"tokens, so a prompt may have at most {window - 1}",
            prompt_field,
            "context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > window:
        raise bad_request(
            f"max_tokens: {max_tokens} with a {num_prompt}-token prompt exceeds this model's "
            f"context window of {window} tokens (at most {window - num_prompt} here)",
            "max_tokens",
            "context_length_exceeded",
        )
