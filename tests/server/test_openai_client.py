"""The official `openai` client against a real `kvabi serve` process on a real socket.

The server runs the tiny random model (exported as an HF folder, so the process loads it in a
second); every answer is compared with `LLM.generate` on the same folder in this process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from kvabi.server.launch import ServerProcess
from tests.engine.tiny import greedy_reference
from tests.server.test_metrics import scrape
from tests.server.tiny_server import tiny_folder

openai = pytest.importorskip("openai")

NAME = "tiny-chat"
MESSAGES = [{"role": "user", "content": "Say something"}]
NUM_CLIENTS = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("model") / NAME)


@pytest.fixture(scope="module")
def server(folder: Path):
    args = ["--model", str(folder), "--dtype", "fp32", "--block-size", "4", "--num-blocks", "1024"]
    with ServerProcess([*args, "--log-level", "warning"], startup_timeout_s=120) as process:
        yield process


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(folder, dtype="fp32", progress=False, block_size=4, num_blocks=1024)


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _greedy(llm: LLM, prompt: str | list[int], max_tokens: int, **params: object):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))[0]


def _metrics(server: ServerProcess) -> dict:
    return scrape(httpx.get(f"{server.url}/metrics").text)


def test_completion_and_chat_answer_as_generate_with_exact_usage(client, llm):
    ref = _greedy(llm, "Hello", 8, ignore_eos=True)
    out = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    prompt_len = len(ref.prompt_token_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 8)
    assert out.usage.total_tokens == prompt_len + 8
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ref = _greedy(llm, ids, 6)
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_streams_carry_the_same_text_and_end_with_usage(client, llm):
    ref = _greedy(llm, "Stream", 10, ignore_eos=True).outputs[0]
    stream = client.completions.create(
        model=NAME,
        prompt="Stream",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ref = _greedy(llm, ids, 6).outputs[0]
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in chat]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == ref.text


def test_n_choices_and_stop_strings(client, llm):
    params = {"max_tokens": 12, "temperature": 0.8, "seed": 3, "n": 3, "ignore_eos": True}
    ref = llm.generate(["fork"], SamplingParams(**params))[0]
    extra = {"ignore_eos": True}
    out = client.completions.create(
        model=NAME, prompt="fork", max_tokens=12, temperature=0.8, seed=3, n=3, extra_body=extra
    )
    assert [c.text for c in out.choices] == [c.text for c in ref.outputs]
    assert out.usage.completion_tokens == 36
    full = ref.outputs[0].text
    stop = next(full[i : i + 2] for i in range(2, len(full)) if full[i : i + 2].isascii())
    out = client.completions.create(
        model=NAME,
        prompt="fork",
        max_tokens=12,
        temperature=0.8,
        seed=3,
        stop=stop,
        extra_body=extra,
    )
    assert (out.choices[0].text, out.choices[0].finish_reason) == (full[: full.find(stop)], "stop")


def test_errors_come_back_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=NAME, prompt="x" * 600)


async def _stream_one(client, prompt: str) -> tuple[str, int, int]:
    stream = await client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    async for chunk in stream:
        text += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    return "".join(text), usage.prompt_tokens, usage.completion_tokens


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_32_concurrent_streaming_clients_get_generates_answers(server, llm):
    prompts = [f"client {i} says" + " hey" * (i % 7) for i in range(NUM_CLIENTS)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    # The server batches them as they arrive, `generate` all 32 at once: the same logits from
    # GEMMs of other row counts. Equal text needs every step clear of a near-tie, checked
    # here (tests/engine/tiny.py); " hi" instead of " hey" had a step with margin 6e-5.
    for prompt in prompts:
        greedy_reference(llm.tokenizer.encode(prompt), 20)

    async def all_clients():
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="none", max_retries=0
        ) as client:
            return await asyncio.gather(*(_stream_one(client, p) for p in prompts))

    before = _metrics(server)
    results = asyncio.run(all_clients())
    rss_first = _rss_bytes(server.process.pid)
    after = _metrics(server)
    for (text, num_prompt, num_completion), ref in zip(results, refs, strict=True):
        assert text == ref.outputs[0].text
        assert (num_prompt, num_completion) == (
            len(ref.prompt_token_ids),
            len(ref.outputs[0].token_ids),
        )

    def grew(name, labels=()):
        return after[name, labels] - before.get((name, labels), 0.0)

    assert grew("kvabi_requests_total", (("outcome", "finished"),)) == NUM_CLIENTS
    assert grew("kvabi_generation_tokens_total") == sum(r[2] for r in results)
    assert grew("kvabi_prompt_tokens_total") == sum(r[1] for r in results)
    assert grew("kvabi_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert after["kvabi_kv_blocks_used", ()] == 0
    assert after["kvabi_requests_running", ()] == after["kvabi_requests_waiting", ()] == 0
    # a second wave in the same process costs no further memory worth the name
    asyncio.run(all_clients())
    assert _rss_bytes(server.process.pid) - rss_first < 64 * 2**20


def _wait_for_abort(server: ServerProcess, aborted_before: float) -> dict:
    for _ in range(500):
        m = _metrics(server)
        aborted = m.get(("kvabi_requests_total", (("outcome", "aborted"),)), 0.0)
        if aborted > aborted_before and m["kvabi_kv_blocks_used", ()] == 0:
            return m
        time.sleep(0.02)
    raise AssertionError(f"no abort seen: {m}")


def test_a_client_that_disconnects_has_its_request_aborted_and_blocks_freed(server):
    body = {"model": NAME, "prompt": "long", "max_tokens": 480, "ignore_eos": True, "n": 4}
    aborted = _metrics(server).get(("kvabi_requests_total", (("outcome", "aborted"),)), 0.0)
    with httpx.stream("POST", f"{server.base_url}/completions", json={**body, "stream": True}) as r:
        events = r.iter_lines()
        assert next(events).startswith("data: ")  # it is running: then the client goes away
    m = _wait_for_abort(server, aborted)
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(f"{server.base_url}/completions", json=body, timeout=0.3)
    m = _wait_for_abort(server, m["kvabi_requests_total", (("outcome", "aborted"),)])
    assert m["kvabi_requests_running", ()] == 0


def test_a_kv_press_through_the_client_answers_as_generate_with_it(client, llm):
    """`kv_press` (a kvabi extension, as `extra_body`): the server presses the prompt's
    context as `LLM.generate` with `SamplingParams.press` does; a press the prompt is too
    short for is a 400 naming the field."""
    prompt = list(range(3, 120))
    press = "snapkv:ratio=0.75,window=16,question=6"
    want = _greedy(llm, prompt, 8, press=press, ignore_eos=True)
    got = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "kv_press": press},
    )  # fmt: skip
    assert got.choices[0].text == want.outputs[0].text
    plain = _greedy(llm, prompt, 8, ignore_eos=True)
    assert want.outputs[0].token_ids != plain.outputs[0].token_ids  # the press changed it
    with pytest.raises(openai.BadRequestError, match="press"):
        client.completions.create(
            model=NAME, prompt=prompt[:20], max_tokens=4,
            extra_body={"kv_press": "snapkv:ratio=0.5,window=64"},
        )  # fmt: skip
