"""Foreign engines' caches as kvabi buffers, and foreign engines as prefill instances.

- model_spec.py: a `ModelSpec` from an HF config or a GGUF file (geometry, RoPE pairing,
  fingerprint).
- sliding.py: a sliding-window (hybrid) cache as one sequence's buffers: full extent, only the
  window of the next position carried.
- hf_cache.py: `DynamicCache` (sliding layers too; MLA latents: `hf-dynamic-mla`) <-> `hf-dynamic`
  buffers; the cache keyword.
- llamacpp_state.py: parse and write llama.cpp's state byte grammar (seq v3/v2, full state;
  iSWA: base then SWA cache).
- llamacpp_model.py: parsed states <-> `llamacpp-*` buffers, in a target context's format.
- llamacpp_context.py: a live llama-cpp-python `Llama`: get/set a seq's state, restore.
- vllm_cache.py: vLLM's CPU cache tensors viewed as `vllm-cpu-*` buffers (vllm not imported).
- foreign_prefill.py: HF transformers and llama.cpp serving a prompt's KV to kvabi decoders.

transformers and llama-cpp-python are imported lazily, by the functions that need them.
"""
