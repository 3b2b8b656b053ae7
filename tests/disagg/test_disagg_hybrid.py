"""Router -> prefill -> decode with real processes on a hybrid model: a tiny random-weight
Gemma 3 (transformers' `Gemma3TextConfig`; layers sliding, full, sliding, sliding with an
8-token window, so its cache has block groups) with the tiny chat model's tokenizer.

A decode instance fetches the prompt's blocks per group (the full group's every block, the
sliding groups' window only, kvabi/cache/group_blocks.py) and continues: greedy text equal to
the colocated run, for the same layout and for another layout and block size (which asks the
prefill for the prompt up to a boundary of both block sizes, since a window's blocks hold for
the end they were sent for).
"""

from __future__ import annotations

import shutil

import pytest

from tests.disagg.processes import Instance, start_all
from tests.disagg.test_disagg import CHAT, colocated, routed, text, tiny_args
from tests.server.tiny_server import tiny_folder

transformers = pytest.importorskip("transformers")
S, F = "sliding_attention", "full_attention"
WINDOW = 8


def gemma3_folder(tmp_path_factory) -> str:
    import torch

    from tests.models.hf_reference import randomize

    base = tiny_folder(tmp_path_factory.mktemp("tiny"))
    config = transformers.Gemma3TextConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_hidden_layers=4,
        sliding_window=WINDOW, layer_types=[S, F, S, S], bos_token_id=0, eos_token_id=256,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gemma3")
    randomize(transformers.Gemma3ForCausalLM(config)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    args = tiny_args(gemma3_folder(tmp_path_factory))
    prefill = Instance(args, "prefill", "hnd", 4)
    peers = ("--kv-peer", prefill.kv_address)
    instances = {
        "prefill": prefill,
        "same": Instance(args, "decode", "hnd", 4, *peers),
        "mixed": Instance(args, "decode", "nhd", 8, *peers),
    }
    start_all(list(instances.values()))
    yield instances
    for i in instances.values():
        i.process.stop()


@pytest.mark.parametrize(("decode", "block_size"), [("same", 4), ("mixed", 8)])
def test_greedy_output_is_identical_to_colocated(fleet, decode, block_size):
    want = colocated(fleet["prefill"], CHAT)
    got = routed([fleet["prefill"]], [fleet[decode]], CHAT)
    assert text(got) == text(want) and text(got)
    num_prompt = got.json()["usage"]["prompt_tokens"]
    assert num_prompt > 4 * WINDOW  # the sliding layers' window moved on many blocks
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // block_size * block_size}"
    assert fleet[decode].free_blocks() == (128, 128)  # nothing leaked, nothing held
    assert fleet["prefill"].free_blocks() == (128, 128)
