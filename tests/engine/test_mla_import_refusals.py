"""An MLA cache offered to an attention model, and the reverse, is refused with a typed error
on every path bytes take into an engine: the container reader (`expect=`), the staging
conversion and `KVCache.import_blocks`; the refused import places nothing and the engine then
serves the prompt as if nothing had been offered.

Both engines have 2 layers and the same fingerprint, so only the layer kinds differ (a tiny
DeepSeek-V3, plain-512: MLA 512 + 64; the tiny Llama: 2 KV heads of 16).
"""

from __future__ import annotations

import re

import pytest

from kvabi.abi.errors import IncompatibleError
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models import load_model
from kvabi.transfer.kv_staging import stage_payload
from kvabi.wire import container_bytes, read_container
from tests.engine.tiny import tiny_engine
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")
BLOCK = 4
PROMPT = [(7 * i + 3) % 90 for i in range(13)]  # 3 full blocks and a partial one
FINGERPRINT = "tiny"  # both engines: the layer kinds are all that differ
AS_TEXT = {"mla": "mla:512+64", "attn": "attn:2x16"}  # the layers, as refusals print them


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLMEngine]:
    from tests.models.test_deepseek_v3 import make_hf

    folder = tmp_path_factory.mktemp("deepseek")
    make_hf("plain-512").save_pretrained(folder)
    write_tokenizer(folder)
    mla = LLMEngine(load_model(folder, progress=False), EngineConfig(block_size=BLOCK), FINGERPRINT)
    attn = tiny_engine(block_size=BLOCK)
    assert attn.info.descriptor.model.fingerprint == FINGERPRINT
    return {"mla": mla, "attn": attn}


def run(engine: LLMEngine, salt: str | None = None) -> list[int]:
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize(("src", "dst"), [("mla", "attn"), ("attn", "mla")])
def test_container_read_refuses_the_other_kind(engines: dict[str, LLMEngine], src, dst) -> None:
    run(engines[src])
    payload = engines[src].cache.export(PROMPT, None)
    assert len(payload.token_ids) == 12
    data = container_bytes(payload.cache, payload.token_ids, payload.block_hashes)
    assert read_container(data, expect=engines[src].info.descriptor.model).token_ids == PROMPT[:12]
    with pytest.raises(
        IncompatibleError, match=re.escape(f"layer 0: {AS_TEXT[dst]} != {AS_TEXT[src]}")
    ):
        read_container(data, expect=engines[dst].info.descriptor.model)


@pytest.mark.parametrize(("src", "dst"), [("mla", "attn"), ("attn", "mla")])
def test_engine_import_refuses_the_other_kind(engines: dict[str, LLMEngine], src, dst) -> None:
    run(engines[src])
    payload = engines[src].cache.export(PROMPT, None)
    target, salt = engines[dst], f"from-{src}"  # a salt the target has no blocks under
    want = run(target)  # the target's own answer (no salt)
    refusal = re.escape(f"layer 0: {AS_TEXT[src]} != {AS_TEXT[dst]}")  # convert: source first
    with pytest.raises(IncompatibleError, match=refusal):
        stage_payload(payload, target.info.descriptor)
    num_free = target.cache.pool.num_free
    with pytest.raises(IncompatibleError, match=refusal):
        target.cache.import_blocks(PROMPT, salt, payload)
    assert target.cache.pool.num_free == num_free  # nothing placed, nothing held
    assert target.cache.num_pooled(target.cache.hasher.hashes(PROMPT, salt)) == 0
    assert run(target, salt) == want  # computed afresh under the salt: the same answer
