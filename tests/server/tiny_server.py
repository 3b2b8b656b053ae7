"""The tiny random model with a chat template: in-process apps, and a folder `kvabi serve` loads."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
from fastapi import FastAPI

from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvabi.models.registry import LoadedModel
from kvabi.models.tokenizer import Tokenizer
from kvabi.server.app import create_app
from kvabi.server.settings import ServerSettings
from tests.engine.tiny import tiny_loaded

T = TypeVar("T")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL = "tiny"


def chat_loaded(seed: int = 0) -> LoadedModel:
    """tests/engine's tiny model, its byte-level tokenizer given a chat template."""
    loaded = tiny_loaded(seed)
    tok = loaded.tokenizer
    return LoadedModel(
        loaded.config, loaded.model, Tokenizer(tok.backend, tok.special_tokens, CHAT_TEMPLATE)
    )


def tiny_chat_engine(hooks: EngineHooks = EngineHooks(), **config: object) -> LLMEngine:
    config = {"block_size": 4, "num_blocks": 256, **config}
    return LLMEngine(chat_loaded(), EngineConfig(**config), fingerprint="tiny", hooks=hooks)


def tiny_folder(path: Path) -> Path:
    """The tiny chat model as an HF folder (fp32), for `kvabi serve --model FOLDER`."""
    from kvabi.models.hf_export import export_hf_folder

    return export_hf_folder(chat_loaded(), path)


def app_for(engine: LLMEngine | None = None, **settings: object) -> FastAPI:
    return create_app(engine or tiny_chat_engine(), ServerSettings(MODEL, **settings))


def with_client(app: FastAPI, fn: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run `fn(client)` against the app in-process, its lifespan (engine thread) around it."""

    async def main() -> T:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvabi") as c:
                return await fn(c)

    return asyncio.run(main())


def sse_events(body: str) -> list[dict | str]:
    """A streamed body's events: parsed JSON, and the final "[DONE]" as the string."""
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def free_blocks(url: str) -> tuple[float, float]:
    """(free, total) blocks of a running server's pool, from its /metrics."""
    text = httpx.get(f"{url}/metrics").text
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("kvabi_kv_blocks_free"), get("kvabi_kv_blocks_total")
