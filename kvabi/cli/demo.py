"""`make run`: a KV cache taken out of llama.cpp, through the ABI, and back into llama.cpp.

llama.cpp prefills a chat prompt on the bundled SmolLM2; its sequence state becomes a kvabi
container (descriptor, tokens, block hashes, checksummed sections); the container is inspected,
converted to vLLM's FlashInfer HND layout, read back with the model checked, and handed to a
fresh llama.cpp context, which must continue exactly as it does from its own prefill. Then
kvabi's own engine answers the same prompt from its paged cache.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.cli.main import main as kvabi_main
from kvabi.interop.llamacpp_context import get_seq_state, greedy_tokens, restore_sequence
from kvabi.interop.llamacpp_model import state_to_buffers
from kvabi.interop.model_spec import model_spec_from_llama
from kvabi.models.registry import bundled_model_path
from kvabi.models.tokenizer import Tokenizer
from kvabi.wire import read_container, write_container

OUT = Path("out/demo")
QUESTION = "What is the capital of France? Answer in one sentence."
NEW_TOKENS = 24


def _llama():  # noqa: ANN202 - llama_cpp.Llama, imported lazily
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(bundled_model_path()), n_ctx=512, n_threads=2, verbose=False
    )


def main() -> int:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed; `make run` installs it", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(bundled_model_path())
    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    print(f"1. llama.cpp prefills {len(ids)} tokens of: {QUESTION!r}")
    source = _llama()
    source.eval(ids)
    model = model_spec_from_llama(source)
    cache = state_to_buffers(get_seq_state(source), model)
    own = greedy_tokens(source, NEW_TOKENS)
    hashes = hash_blocks(ids, 16, root_hash(model.compat_digest()))
    first = OUT / "llamacpp.kvabi"
    write_container(first, cache, ids, hashes)
    print(f"2. its KV state as a kvabi container: {first}")
    kvabi_main(["inspect", str(first)])
    # vLLM runs the HF weights: its K is in the `half` RoPE pairing, llama.cpp's in `pairs`.
    hf_side = replace(model, rope_pairing="half")
    vllm_desc = preset_descriptor("vllm-flashinfer-hnd", hf_side, dtype="f16")
    vllm = convert(cache, vllm_desc, num_tokens=len(ids))
    second = OUT / "vllm-flashinfer-hnd.kvabi"
    write_container(second, vllm, ids, hashes)
    print(
        f"\n3. converted (losslessly: f16, K re-paired) to vLLM's FlashInfer HND layout, "
        f"16-token blocks: {second}"
    )
    kvabi_main(["inspect", str(second)])
    back = read_container(second, expect=model)  # checksums and model verified
    target = _llama()
    restore_sequence(target, back.cache, model, ids)
    resumed = greedy_tokens(target, NEW_TOKENS)
    print("\n4. a fresh llama.cpp context continues from the converted cache:")
    print(f"   from its own prefill: {_text(tok, own)!r}")
    print(f"   from the kvabi cache: {_text(tok, resumed)!r}")
    same = own == resumed
    print(f"   {NEW_TOKENS} greedy tokens identical: {same}")
    _engine_answers(ids)
    return 0 if same else 1


def _engine_answers(ids: list[int]) -> None:
    """The kvabi engine (paged KV in HND blocks, a descriptor like the ones above) answers too."""
    from kvabi.engine.llm import LLM
    from kvabi.engine.sampling_params import SamplingParams

    llm = LLM(dtype="auto", kv_layout="hnd", progress=False)
    print(f"\n5. kvabi's own engine, cache layout {llm.engine.info.descriptor.layout.name}:")
    print("   ", end="")
    for delta in llm.stream(ids, SamplingParams(max_tokens=48, temperature=0)):
        print(delta.text, end="", flush=True)
    print()


def _text(tok: Tokenizer, ids: list[int]) -> str:
    """The reply up to its end-of-turn token (the comparison itself covers every token)."""
    ends = [ids.index(e) for e in tok.eos_token_ids if e in ids]
    return tok.decode(ids[: min(ends, default=len(ids))], skip_special_tokens=True)


if __name__ == "__main__":
    sys.exit(main())
