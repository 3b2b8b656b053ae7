"""Foreign engines as prefill instances, in their own processes, feeding a real kvabi decode
instance on the bundled SmolLM2 (fp32): `kvabi prefill-worker --engine hf` (HF's forward, HND,
16-token blocks, fp32) and `--engine llamacpp` (llama.cpp's f16 state bytes, K in llama.cpp's
`pairs` order, NHD, 32-token blocks); the decode instance (NHD, 16-token blocks) converts.

Greedy output is compared on prompts whose continuation is certain (no near-ties: the engines'
own numerics differ, see tests/interop/test_cross_engine.py): HF-prefill -> kvabi-decode equals
HF alone; llama.cpp-prefill -> kvabi-decode equals llama.cpp alone and kvabi colocated. Each
request has its own cache salt, so no request finds another's blocks in the decode pool, and
the `x-kvabi-kv` header says the decode instance fetched the prompt's full blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from kvabi.server.launch import ServerProcess
from tests.conftest import bundled_gguf_path
from tests.disagg.processes import ENV, Instance, start_all, tiny_args
from tests.disagg.worker_process import WorkerProcess
from tests.server.tiny_server import tiny_folder

pytestmark = pytest.mark.slow
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
COUNTING = ", ".join(str(i) for i in range(1, 41)) + ","  # -> " 41, 42, ..." (certain)
NUM_NEW = 16


@dataclass
class Deployment:
    hf: WorkerProcess
    llama: WorkerProcess
    decode: Instance
    llm: object  # llama_cpp.Llama in this process: tokenizer and llama.cpp-alone reference

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def complete(self, ids: list[int], peer: str, salt: str, max_tokens: int) -> httpx.Response:
        """Greedy /v1/completions on the decode instance, its KV fetched from `peer`."""
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt}
        r = httpx.post(
            f"{self.decode.url}/v1/completions",
            json=body,
            headers={"x-kvabi-prefill": peer},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    path = bundled_gguf_path()
    hf = WorkerProcess("hf", "--dtype", "fp32", "--kv-layout", "hnd", "--block-size", "16")
    llama = WorkerProcess("llamacpp", "--kv-layout", "nhd", "--block-size", "32", "--threads", "1")
    peers = ["--kv-peer", hf.kv_address, "--kv-peer", llama.kv_address]
    decode = Instance(["--dtype", "fp32", "--num-blocks", "256"], "decode", "nhd", 16, *peers)
    try:
        hf.start(), llama.start()
        start_all([decode])
        hf.wait_ready(), llama.wait_ready()
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, n_threads=1)
        yield Deployment(hf, llama, decode, llm)
    finally:
        decode.process.stop(), hf.stop(), llama.stop()


def fetched(r: httpx.Response, block_size: int) -> str:
    """The header value of a decode that fetched every full block of the peer's size."""
    num_prompt = r.json()["usage"]["prompt_tokens"]
    return f"prefill;tokens={num_prompt // block_size * block_size}"


@pytest.mark.parametrize(("prompt", "max_tokens"), [(CHAT, 7), (COUNTING, NUM_NEW)])
def test_hf_prefill_then_kvabi_decode_equals_hf_alone(deployment, hf_smollm2, prompt, max_tokens):
    ids = deployment.tokens(prompt)
    r = deployment.complete(ids, deployment.hf.kv_address, f"hf-{max_tokens}", max_tokens)
    assert r.headers["x-kvabi-kv"] == fetched(r, 16)
    with torch.no_grad():
        out = hf_smollm2.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    want = deployment.llm.detokenize(out[0, len(ids) :].tolist()).decode()
    assert r.json()["choices"][0]["text"] == want
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_llamacpp_prefill_then_kvabi_decode_equals_llamacpp_and_colocated(deployment):
    from kvabi.interop.llamacpp_context import greedy_tokens

    ids = deployment.tokens(COUNTING)
    r = deployment.complete(ids, deployment.llama.kv_address, "llamacpp", NUM_NEW)
    assert r.headers["x-kvabi-kv"] == fetched(r, 32)
    deployment.llm.reset()
    deployment.llm.eval(ids)
    alone = deployment.llm.detokenize(greedy_tokens(deployment.llm, NUM_NEW)).decode()
    colocated = deployment.complete(ids, "none", "colocated", NUM_NEW)  # not a peer: local
    assert colocated.headers["x-kvabi-kv"] == "local;reason=no-peer"
    text = r.json()["choices"][0]["text"]
    assert text == alone == colocated.json()["choices"][0]["text"]
    assert text.startswith(" 41, 42, 43,")


def test_a_worker_of_another_model_is_refused_at_connect_time(deployment, tmp_path):
    """A decode instance of the tiny model names the SmolLM2 llama.cpp worker: it does not
    start, and says why (the handshake compares the models before any request)."""
    args = [*tiny_args(str(tiny_folder(tmp_path))), "--role", "decode"]
    decode = ServerProcess([*args, "--kv-peer", deployment.llama.kv_address], env=ENV)
    with pytest.raises(RuntimeError, match="exited during start-up") as info:
        decode.start().wait_ready()
    message = str(info.value)
    assert "peer refused at connect time: caches are of different models" in message
    assert "model fingerprint 'hf-sha256:" in message and "gguf-sha256:" in message
    assert "num_layers 2 != 30" in message
    assert "serving KV on" in deployment.llama.output()  # the worker itself is still up
    assert deployment.llama.process.poll() is None
