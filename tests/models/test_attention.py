"""ContiguousAttention against a plain softmax(QK^T)V reference; the model with it, step by step."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi.descriptor import ATTN, MLA, SHARED, LayerSpec
from kvabi.models import ContiguousAttention, LlamaModel, ModelConfig
from tests.models.tiny import our_logits, our_logits_incremental, random_ids

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """All of one sequence at once; query t is at position L - T + t."""
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / HEAD_DIM**0.5
    t_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    l_pos = torch.arange(k.shape[0])[None, :]
    allowed = (l_pos <= t_pos) & (l_pos > t_pos - (window or 10**9))
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", weights, v)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("chunks", [(9,), (1, 1, 1, 1, 1, 1, 1, 1, 1), (4, 1, 3, 1)])
def test_chunked_calls_match_reference(window: int | None, chunks: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    total = sum(chunks)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(2, total, NUM_KV_HEADS, HEAD_DIM)
    layer = LayerSpec(ATTN, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, window=window or 0)
    attn = ContiguousAttention((layer, layer))
    start = 0
    for size in chunks:
        end = start + size
        out = attn(1, q[start:end], k[start:end], v[start:end])
        expected = reference(q[start:end], k[:end], v[:end], window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        start = end
    assert attn.num_tokens == total
    attn.reset()
    assert attn.num_tokens == 0


def test_incremental_decode_equals_one_prefill() -> None:
    torch.manual_seed(0)
    config = ModelConfig(96, 64, 128, 2, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    model = LlamaModel(config).eval()
    ids = random_ids(12)
    torch.testing.assert_close(
        our_logits_incremental(model, ids, prefill=5), our_logits(model, ids), atol=1e-5, rtol=0
    )


def test_the_model_hands_post_rope_k_to_the_attention() -> None:
    config = ModelConfig(96, 64, 128, 1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    model = LlamaModel(config).eval()
    seen: list[tuple[int, torch.Size, torch.Size]] = []
    keys: list[torch.Tensor] = []

    def spy(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((layer_id, q.shape, k.shape))
        keys.append(k)
        return torch.zeros_like(q)

    ids = torch.tensor([5, 5])  # same token: K differs only through RoPE
    model(ids, torch.tensor([0, 3]), spy)
    assert seen == [(0, torch.Size([2, 4, 16]), torch.Size([2, 2, 16]))]
    assert not torch.allclose(keys[0][0], keys[0][1])


def test_a_shared_layer_attends_to_its_targets_kv() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 5, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(2, 5, NUM_KV_HEADS, HEAD_DIM)
    target = LayerSpec(ATTN, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, window=3)
    attn = ContiguousAttention((target, LayerSpec(SHARED, shares=0, window=3)))
    for start, end in ((0, 4), (4, 5)):
        attn(0, q[0, start:end], k[start:end], v[start:end])
        out = attn(1, q[1, start:end], None, None)
        torch.testing.assert_close(out, reference(q[1, start:end], k[:end], v[:end], 3))
    assert attn.keys[1] is None  # the shared layer stores nothing


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="layers"):
        ContiguousAttention(())


def test_mla_layer_attends_absorbed_over_its_latents() -> None:
    """An MLA layer: keys [c_kv | k_pe] (one head), values c_kv, scale 1/sqrt(latent + rope);
    the latents are kept as HF's DeepSeek cache keeps them (keys c_kv, values k_pe)."""
    torch.manual_seed(0)
    attn = ContiguousAttention([LayerSpec(MLA, latent_dim=8, rope_dim=4)])
    q, c_kv, k_pe = torch.randn(5, 3, 12), torch.randn(5, 1, 8), torch.randn(5, 1, 4)
    first = attn(0, q[:3], c_kv[:3], k_pe[:3])
    rest = attn(0, q[3:], c_kv[3:], k_pe[3:])  # two more tokens, after the first three
    keys = torch.cat((c_kv, k_pe), dim=-1)[:, 0]  # [5, 12]
    scores = q.transpose(0, 1) @ keys.T / 12**0.5  # [3 heads, 5, 5]
    scores = scores + torch.full((5, 5), float("-inf")).triu(1)
    want = (scores.softmax(-1) @ c_kv[:, 0]).transpose(0, 1)  # [5, 3, 8]
    torch.testing.assert_close(torch.cat((first, rest)), want, atol=1e-6, rtol=0)
    assert torch.equal(attn.keys[0], c_kv) and torch.equal(attn.values[0], k_pe)
