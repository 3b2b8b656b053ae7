"""HF models as references for architectures with their own config (Gemma 4, Laguna).

A tiny random HF model is saved with `save_pretrained` and read back through kvabi's loader;
greedy decoding runs through `ContiguousAttention`, one token per forward pass after a prefill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvabi.models import ContiguousAttention, load_hf
from kvabi.models.checkpoint import AnyModel
from tests.models.tiny import hf_logits, our_logits, our_logits_incremental, random_ids

# fp32 logit tolerance: the attention kernels differ (HF's SDPA over a mask tensor, ours over
# ContiguousAttention's), by a few ulps per layer; Gemma 4's four sandwich norms per layer carry
# that through. Measured up to 8e-6 on logits up to ~3.2 (about 16 float32 ulps) on an AVX2
# CPU, and 2.2e-5 on an AVX-512 Zen 4 (its GEMMs block rows otherwise: the incremental path's
# one-row forwards round apart from HF's whole prompt), hence 5e-5 (about 100 ulps).
FP32_LOGIT_TOL = 5e-5


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight non-trivial: norms and scales (Gemma 4's `layer_scalar` buffer too) around
    1, the rest around 0."""
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors |= {n: b for n, b in model.named_buffers() if n.endswith("layer_scalar")}
    with torch.no_grad():
        for name, tensor in tensors.items():
            is_scale = "norm" in name or name.endswith(("layer_scalar", "scale"))
            noise = torch.randn(tensor.shape, generator=generator)
            tensor.copy_((1.0 if is_scale else 0.0) + 0.15 * noise)
    return model.eval()


def save_and_load(hf: torch.nn.Module, folder: Path) -> AnyModel:
    hf.save_pretrained(folder)
    return load_hf(folder, progress=False).build()


@torch.no_grad()
def our_greedy(model: AnyModel, prompt: torch.Tensor, num_new: int) -> list[int]:
    """Prefill the prompt, then decode `num_new` tokens one forward pass each."""
    attn = ContiguousAttention.for_config(model.config)  # type: ignore[arg-type]
    logits = model(prompt, torch.arange(prompt.shape[0]), attn)
    tokens = [int(logits[-1].argmax())]
    for pos in range(prompt.shape[0], prompt.shape[0] + num_new - 1):
        logits = model(torch.tensor(tokens[-1:]), torch.tensor([pos]), attn)
        tokens.append(int(logits[-1].argmax()))
    return tokens


@torch.no_grad()
def hf_greedy(hf: Any, prompt: torch.Tensor, num_new: int) -> tuple[list[int], list[float]]:
    """HF `generate(do_sample=False)` (no EOS stop): tokens and each step's top-2 margin."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt)[None],  # else HF masks pad_token_id in the prompt
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=0,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, prompt.shape[0] :].tolist(), margins


def assert_logits_equal(hf: Any, model: AnyModel) -> None:
    """Whole-prompt logits equal HF's, on a prompt of several windows."""
    ids = random_ids(24)
    expected = hf_logits(hf, ids)
    assert expected.abs().max() > 1.0  # weights are large enough for the check to bite
    torch.testing.assert_close(our_logits(model, ids), expected, atol=FP32_LOGIT_TOL, rtol=0)


def assert_incremental_equal(hf: Any, model: AnyModel) -> None:
    """A 7-token prefill, then one token per forward, equal HF's whole-prompt logits."""
    ids = random_ids(24)
    got = our_logits_incremental(model, ids, prefill=7)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=FP32_LOGIT_TOL, rtol=0)


def assert_greedy_equal(hf: Any, model: AnyModel) -> None:
    """16 greedy tokens equal HF `generate`'s, every step clear of a near-tie."""
    prompt = random_ids(10, seed=3)
    want, margins = hf_greedy(hf, prompt, 16)
    assert min(margins) > 2 * FP32_LOGIT_TOL  # no near-tie: equality is guaranteed, not luck
    assert our_greedy(model, prompt, 16) == want
