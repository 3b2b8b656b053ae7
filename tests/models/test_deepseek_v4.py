"""DeepSeek V4 (tiny random HF models, saved and loaded through kvabi) against transformers 5.24's
`DeepseekV4ForCausalLM`: logits of a whole prompt, of a prompt fed in chunks and one token at a
time, greedy tokens, and the compressed entries of every layer equal HF's `compressed_kv`.

Two configs, each with sliding, CSA and HCA layers: "tiny" (m = 4 and m' = 8, one hash-routed
MoE layer) and "yarn" (the compressed layers' RoPE under YaRN, hc_mult 4 with 20 Sinkhorn
iterations, sigmoid routing). Every weight is random (HF zero-initialises sinks, position
biases, mixes and the hash table, which would hide their handling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.models import load_hf
from kvabi.models.compressed_attention import ContiguousCompressedAttention
from kvabi.models.deepseek_v4 import DeepseekV4Model
from kvabi.models.deepseek_v4_config import CSA, HCA, SLIDING, read_deepseek_v4_config
from kvabi.models.errors import CheckpointError
from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy, randomize
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
ENTRY_TOL = 1e-6  # the bound for compressed entries against HF's
COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 24,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 8,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 3,
    "partial_rotary_factor": 0.5,  # RoPE on the trailing 8 of 16 channels
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "num_hidden_layers": 3,
        "layer_types": [SLIDING, CSA, HCA],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {CSA: 4, HCA: 8},
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
    },
    "yarn": {
        "num_hidden_layers": 4,
        "layer_types": [HCA, CSA, SLIDING, CSA],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "compress_rates": {CSA: 2, HCA: 4},
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "scoring_func": "sigmoid",
        "index_topk": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
}


def make_hf(variant: str) -> Any:
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**{**COMMON, **CONFIGS[variant]})
    hf = randomize(transformers.DeepseekV4ForCausalLM(config))
    generator = torch.Generator().manual_seed(1)
    for layer in hf.model.layers:  # hash routing: distinct random experts per token id
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            picks = torch.rand(gate.tid2eid.shape[0], 4, generator=generator).argsort(dim=-1)
            gate.tid2eid.copy_(picks[:, : gate.tid2eid.shape[1]])
        else:
            gate.e_score_correction_bias.copy_(0.1 * torch.randn(4, generator=generator))
    return hf.eval()


class Served:
    def __init__(self, variant: str, folder: Path) -> None:
        self.hf = make_hf(variant)
        self.hf.save_pretrained(folder)
        self.model = load_hf(folder, progress=False).build()
        self.config = self.model.config

    def attention(self) -> ContiguousCompressedAttention:
        c = self.config
        return ContiguousCompressedAttention(c.num_layers, c.sliding_window)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(request.param, tmp_path_factory.mktemp(request.param))


@torch.no_grad()
def ours(served: Served, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of `ids` fed in chunks of the given sizes (one cache throughout)."""
    attn, out, start = served.attention(), [], 0
    for size in chunks:
        part = ids[start : start + size]
        out.append(served.model(part, torch.arange(start, start + len(part)), attn))
        start += size
    assert start == len(ids)
    return torch.cat(out)


@torch.no_grad()
def hf_logits(hf: Any, ids: torch.Tensor, chunks: list[int] | None = None) -> torch.Tensor:
    """HF's logits of `ids`, whole or fed in chunks through one cache."""
    if chunks is None:
        return hf(ids[None]).logits[0]
    cache, out, start = transformers.DynamicCache(config=hf.config), [], 0
    for size in chunks:
        positions = torch.arange(start, start + size)[None]
        out.append(
            hf(ids[None, start : start + size], cache=cache, position_ids=positions).logits[0]
        )
        start += size
    return torch.cat(out)


def test_config_reads_hfs(served: Served) -> None:
    c, hf = served.config, served.hf.config
    assert c.layer_types == tuple(hf.layer_types)
    assert (c.csa_rate, c.hca_rate) == (hf.compress_rates[CSA], hf.compress_rates[HCA])
    assert c.qk_rope_head_dim == hf.qk_rope_head_dim == 8
    assert isinstance(served.model, DeepseekV4Model)
    is_yarn = hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert (c.compress_rope_scaling is not None) == is_yarn
    assert c.scoring_func == hf.scoring_func


def test_bf16_keeps_hfs_float32_weights(served: Served, tmp_path: Path) -> None:
    """Loaded in bf16, the weights transformers keeps in float32 stay float32 (and the hash
    table integer); the model runs and its logits follow HF's bf16 run."""
    served.hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype="bf16", progress=False).build()
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    assert params["layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    for name in ("layers.0.attn_hc.fn", "hc_head.hc_fn", "layers.0.self_attn.sinks",
                 "layers.1.self_attn.kv_norm.weight", "norm.weight"):  # fmt: skip
        assert params[name].dtype == torch.float32, name
    assert params["layers.0.mlp.gate.tid2eid"].dtype == torch.long
    ids = random_ids(21)
    attn = ContiguousCompressedAttention(model.config.num_layers, model.config.sliding_window)
    with torch.no_grad():
        got = model(ids, torch.arange(21), attn).float()
    bf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = hf_logits(bf16.eval(), ids).float()
    # equal to the bit here (measured: same ops, same shapes); a few bf16 ulps allowed for
    # CPUs whose GEMMs block otherwise (an ulp at |logit| ~3 is 2^-6)
    assert (got - want).abs().max() <= 4 * 2**-6


def test_prompt_logits_equal_hf(served: Served) -> None:
    ids = random_ids(37)  # windows of 8 slide past; entries of 4 and 8 (2 and 4) close
    want = hf_logits(served.hf, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(ours(served, ids, [37]), want, atol=FP32_LOGIT_TOL, rtol=0)


@pytest.mark.parametrize("chunks", [[5, 3, 9, 1, 19], [11] + [1] * 26])
def test_chunked_and_token_by_token_logits_equal_hf(served: Served, chunks: list[int]) -> None:
    """Windows and entries close across chunk boundaries (partial windows carried in the
    compressor state, CSA's overlap too). Compared with HF fed the same chunks: a CSA query's
    top-k can part at a near-tie of index scores (ReLU zeroes many), so chunking may change
    the picks; it does in HF itself on the "tiny" config at position 15 (measured)."""
    ids = random_ids(37)
    want = hf_logits(served.hf, ids, chunks)
    torch.testing.assert_close(ours(served, ids, chunks), want, atol=FP32_LOGIT_TOL, rtol=0)


@torch.no_grad()
def test_compressed_entries_equal_hfs(served: Served) -> None:
    ids = random_ids(37)
    cache = served.hf(ids[None], use_cache=True).cache
    attn = served.attention()
    served.model(ids, torch.arange(37), attn)
    compared = 0
    for i, layer in enumerate(cache.layers):
        for name, entries in getattr(layer, "compressed_kv", {}).items():
            got = attn.entries[i][name]
            assert got.shape == entries[0].shape and got.shape[0] == 37 // layer.compress_rate
            torch.testing.assert_close(got, entries[0], atol=ENTRY_TOL, rtol=0)
            buffered = attn.states[i][name].num_buffered
            assert buffered == layer.buffer_kv[name].shape[1] == 37 % layer.compress_rate
            compared += 1
    types = served.config.layer_types
    assert compared == 2 * types.count(CSA) + types.count(HCA)  # CSA: entries and the indexer's


def test_greedy_equals_hf_generate(served: Served) -> None:
    prompt = random_ids(13, seed=3)
    want, margins = hf_greedy(served.hf, prompt, 20)
    assert min(margins) > 2 * FP32_LOGIT_TOL  # no near-tie: equality is guaranteed, not luck
    attn, tokens = served.attention(), []
    with torch.no_grad():
        logits = served.model(prompt, torch.arange(13), attn)
        for pos in range(13, 13 + 20):
            tokens.append(int(logits[-1].argmax()))
            logits = served.model(torch.tensor(tokens[-1:]), torch.tensor([pos]), attn)
    assert tokens == want


def indexers(model: DeepseekV4Model) -> list[Any]:
    compressors = [layer.self_attn.compressor for layer in model.layers]
    return [c.indexer for c in compressors if c is not None and hasattr(c, "indexer")]


def test_sparse_picks_matter(served: Served) -> None:
    """Letting every CSA query see every entry changes the logits: the top-k bites."""
    ids = random_ids(37)
    try:
        for indexer in indexers(served.model):
            indexer.topk = 64
        dense = ours(served, ids, [37])
    finally:
        for indexer in indexers(served.model):
            indexer.topk = served.config.index_topk
    assert (dense - hf_logits(served.hf, ids)).abs().max() > 1e-3


def test_refusals() -> None:
    raw = transformers.DeepseekV4Config(**{**COMMON, **CONFIGS["tiny"]}).to_dict()
    for key, value in (
        ("num_key_value_heads", 2),
        ("quantization_config", {"quant_method": "fp8"}),
        ("scoring_func", "softmax"),
        ("layer_types", [SLIDING, "full_attention", HCA]),
    ):
        with pytest.raises(CheckpointError, match=key.split("_")[0]):
            read_deepseek_v4_config({**raw, key: value})
