"""`widen_gguf`: the bundled GGUF re-encoded at kvabi's precision for llama.cpp (`kvabi bench
throughput` runs llama.cpp on it beside the shipped q4_1 file)."""

import pytest
import torch
from gguf import GGMLQuantizationType

from kvabi.models.gguf_loader import load_gguf, open_gguf
from kvabi.models.gguf_widen import widen_gguf
from kvabi.models.registry import bundled_model_path

SOURCE = bundled_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    return widen_gguf(SOURCE, tmp_path_factory.mktemp("gguf") / "smol-bf16.gguf", "bf16")


def test_the_widened_file_holds_the_weights_kvabi_computes_with(widened):
    # every tensor kvabi loads from the shipped file in bf16 is the same bits from the copy
    shipped, wide = load_gguf(SOURCE, "bf16", progress=False), load_gguf(widened, "bf16", False)
    assert shipped.config == wide.config
    assert shipped.state_dict.keys() == wide.state_dict.keys()
    for name, tensor in shipped.state_dict.items():
        assert torch.equal(tensor, wide.state_dict[name]), name


def test_quantised_tensors_become_bf16_and_everything_else_is_copied(widened):
    src, dst = open_gguf(SOURCE), open_gguf(widened)
    kinds = {t.name: t.tensor_type for t in dst.tensors}
    for t in src.tensors:
        kept = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        assert kinds[t.name] == (t.tensor_type if kept else GGMLQuantizationType.BF16), t.name
    assert any(t.tensor_type == GGMLQuantizationType.Q4_1 for t in src.tensors)
    skip = {"GGUF.kv_count", "GGUF.tensor_count"}
    for name, field in src.fields.items():
        if name not in skip:
            assert dst.fields[name].contents() == field.contents(), name


def test_llama_cpp_reads_it_and_agrees_with_kvabi_on_the_next_token(widened):
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvabi.engine.llm import LLM
    from kvabi.engine.sampling_params import SamplingParams

    prompt = "The capital of France is"
    llm = llama_cpp.Llama(model_path=str(widened), n_ctx=256, n_threads=2, verbose=False)
    theirs = llm.create_completion(prompt, max_tokens=3, temperature=0)["choices"][0]["text"]
    ours = (
        LLM(dtype="bf16", progress=False)
        .generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
        .outputs[0]
        .text
    )
    assert theirs.split()[0] == ours.split()[0] == "Paris."


def test_refuses_a_precision_it_does_not_write(tmp_path):
    with pytest.raises(ValueError, match="one of"):
        widen_gguf(SOURCE, tmp_path / "x.gguf", "q8_0")
    assert not list(tmp_path.iterdir())
