"""Gemma 4's assistant drafter against transformers' `Gemma4AssistantForCausalLM` driven by HF's
own candidate generator (`SinglePositionMultiTokenCandidateGenerator`) over a tiny random target:
the same draft tokens and logits, from the target's K/V as HF returns it (full layers: every key;
sliding layers: the last window + 1); pairing and config refusals.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.models import load_model
from kvabi.models.errors import CheckpointError
from kvabi.models.gemma4_assistant import (
    SharedKV,
    check_pairing,
    feeding_layers,
    load_gemma4_assistant,
    read_gemma4_assistant_config,
)
from tests.models import test_gemma4
from tests.models.hf_reference import randomize
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
S, F = test_gemma4.S, test_gemma4.F
NUM_DRAFT = 4
# per target variant: the assistant's text config (kv heads and head dims of the target's
# feeding layers; its own hidden size, heads, layer types and a window unlike the target's)
ASSISTANTS: dict[str, dict[str, Any]] = {
    "shared-kv": {
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": 3,
        "layer_types": [S, F, F],
    },
    "moe-softcap": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "global_head_dim": 24,
        "sliding_window": 5,
        "layer_types": [S, F],
    },
}


def make_assistant(variant: str, ordered: bool, seed: int = 1) -> Any:
    """A random HF assistant for test_gemma4's target `variant`; `ordered`: the centroid head
    with a random token ordering."""
    target = test_gemma4.CONFIGS[variant]
    text = transformers.Gemma4TextConfig(
        **{**test_gemma4.COMMON, "rope_parameters": test_gemma4.ROPE, **ASSISTANTS[variant]},
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    config = transformers.Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=3,
    )
    torch.manual_seed(seed)
    hf = randomize(transformers.Gemma4AssistantForCausalLM(config), seed)
    if ordered:
        generator = torch.Generator().manual_seed(seed)
        perm = torch.randperm(config.text_config.vocab_size, generator=generator)
        hf.masked_embedding.token_ordering.copy_(perm)
    hf.generation_config.num_assistant_tokens = NUM_DRAFT
    return hf


def hf_drafts(target: Any, assistant: Any, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's drafts after the target prefilled `ids[:-1]` (ids[-1]: the token it emitted)."""
    out = target(torch.tensor([ids[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
    gen = transformers.generation.candidate_generator.SinglePositionMultiTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), copy.deepcopy(target.generation_config)
    )
    gen.main_model_max_length = 10_000
    full = torch.tensor([ids])
    candidates, logits = gen.get_candidates(
        full, {"attention_mask": torch.ones_like(full)}, out, False, 0
    )
    return candidates[0, len(ids) :].tolist(), logits[0]


def our_shared(target: Any, assistant: Any, prompts: list[list[int]]) -> dict[str, SharedKV]:
    """The target's K/V at its feeding layers (HF's cache, each prompt alone), padded into one
    batch the way the engine gathers it: full layers every key, sliding the last W + 1."""
    shared: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for ids in prompts:
        out = target(torch.tensor([ids[:-1]]), return_shared_kv_states=True)
        for kind, (k, v) in out.shared_kv_states.items():
            shared.setdefault(kind, []).append((k[0].transpose(0, 1), v[0].transpose(0, 1)))
    result = {}
    for kind, rows in shared.items():
        window = assistant.window(kind)
        rows = [(k[-window:], v[-window:]) if window else (k, v) for k, v in rows]
        width = max(k.shape[0] for k, _ in rows)
        keys = torch.zeros(len(rows), width, *rows[0][0].shape[1:])
        values = torch.zeros_like(keys)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (k, v) in enumerate(rows):
            keys[b, : len(k)], values[b, : len(v)], valid[b, : len(k)] = k, v, True
        result[kind] = SharedKV(keys, values, valid)
    return result


@pytest.fixture(scope="module", params=[(v, o) for v in sorted(ASSISTANTS) for o in (False, True)])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    variant, ordered = request.param
    hf_target, hf_assistant = test_gemma4.make_hf(variant), make_assistant(variant, ordered)
    folder = tmp_path_factory.mktemp(f"{variant}-{ordered}")
    hf_target.save_pretrained(folder / "target")
    write_tokenizer(folder / "target")
    hf_assistant.save_pretrained(folder / "assistant")
    target = load_model(folder / "target", progress=False)
    assistant = load_gemma4_assistant(folder / "assistant", target.config)
    return hf_target, hf_assistant, target, assistant


@pytest.mark.parametrize("length", [2, 5, 13])  # inside, at and past the windows (3 to 6)
def test_drafts_equal_hf_candidate_generator(pair: Any, length: int) -> None:
    hf_target, hf_assistant, target, assistant = pair
    ids = random_ids(length, seed=length).tolist()
    want_tokens, want_logits = hf_drafts(hf_target, hf_assistant, ids)
    out = hf_target(torch.tensor([ids[:-1]]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0, -1:]
    shared = our_shared(hf_target, assistant, [ids])
    embed = target.model.embed_tokens
    got = assistant.draft(
        embed, torch.tensor(ids[-1:]), hidden, torch.tensor([length - 1]), shared, NUM_DRAFT
    )
    assert got[0].tolist() == want_tokens
    # the logits of the first round, as HF's (the rest follow from the tokens)
    inputs = torch.cat([embed(torch.tensor(ids[-1:])), hidden], dim=-1)
    _, logits = assistant(inputs, torch.tensor([length - 1]), shared)
    torch.testing.assert_close(logits[0], want_logits[0], atol=1e-5, rtol=1e-5)


def test_a_padded_batch_drafts_as_each_alone(pair: Any) -> None:
    hf_target, _, target, assistant = pair
    prompts = [random_ids(n, seed=20 + n).tolist() for n in (3, 11, 7)]
    hidden = torch.cat(
        [
            hf_target(torch.tensor([p[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1:]
            for p in prompts
        ]  # fmt: skip
    )
    last = torch.tensor([p[-1] for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    embed = target.model.embed_tokens
    batch = assistant.draft(
        embed, last, hidden, positions, our_shared(hf_target, assistant, prompts), NUM_DRAFT
    )
    for b, p in enumerate(prompts):
        alone = assistant.draft(
            embed, last[b : b + 1], hidden[b : b + 1], positions[b : b + 1],
            our_shared(hf_target, assistant, [p]), NUM_DRAFT,
        )  # fmt: skip
        assert batch[b].tolist() == alone[0].tolist()


def test_feeding_layers_are_hfs_store_layers() -> None:
    for variant in ASSISTANTS:
        hf = transformers.Gemma4TextConfig(**test_gemma4.COMMON, **test_gemma4.CONFIGS[variant])
        target = _target(variant)
        store = [i for i, m in enumerate(hf.kv_sharing_modes) if m == "store"]
        assert sorted(feeding_layers(target).values()) == store
        assert {hf.layer_types[i]: i for i in store} == feeding_layers(target)


def _raw(variant: str = "shared-kv") -> dict[str, Any]:
    return make_assistant(variant, False).config.to_dict()


def _target_raw(variant: str) -> dict[str, Any]:
    return transformers.Gemma4TextConfig(
        **test_gemma4.COMMON, **test_gemma4.CONFIGS[variant]
    ).to_dict()


def _target(variant: str) -> Any:
    return test_gemma4.read_gemma4_config(_target_raw(variant))


def test_an_assistant_for_another_target_is_refused() -> None:
    mine = read_gemma4_assistant_config(_raw("shared-kv"))
    check_pairing(mine, _target("shared-kv"))
    with pytest.raises(CheckpointError, match="backbone_hidden_size"):
        check_pairing(mine, _target("moe-softcap"))
    other = read_gemma4_assistant_config(_raw("moe-softcap"))
    raw = {**_target_raw("moe-softcap"), "head_dim": 8}  # the sliding layers' head dim differs
    with pytest.raises(CheckpointError, match="kv heads, head dim"):
        check_pairing(other, test_gemma4.read_gemma4_config(raw))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gemma4_text"}, "model_type"),
        ({"text_config": {"hidden_size_per_layer_input": 8}}, "hidden_size_per_layer_input"),
        ({"text_config": {"enable_moe_block": True}}, "enable_moe_block"),
        ({"text_config": {"num_kv_shared_layers": 1}}, "share the target"),
        ({"use_ordered_embeddings": True, "num_centroids": 7}, "num_centroids"),
    ],
)
def test_configs_kvabi_cannot_run_are_refused(change: dict[str, Any], match: str) -> None:
    raw = _raw()
    text = {**raw["text_config"], **change.pop("text_config", {})}
    with pytest.raises(CheckpointError, match=match):
        read_gemma4_assistant_config({**raw, **change, "text_config": text})


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    make_assistant("shared-kv", False).config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_gemma4_assistant(tmp_path, _target("shared-kv"))
