"""GGUF file -> `Checkpoint` (ModelConfig + HF-equivalent weights), via gguf-py.

Each tensor is dequantised by its own type (a "Q4_1" file also holds Q6_K/Q8_0/F32 tensors).
For archs whose converter permuted Q/K rows so llama.cpp's adjacent-pair RoPE matches HF's
rotate_half (llama, and Mistral converted as llama), the permutation is undone: HF row
h*d + a*d/2 + i is GGUF row h*d + 2i + a. NEOX archs (qwen2, gemma3) were not permuted.
Gemma's converter stores every RMSNorm weight as w + 1 (llama.cpp multiplies by the weight, HF
by 1 + weight): the loader subtracts the 1 again, as transformers' own GGUF loader does.
Reference: the kv-layouts notes, section 6 (gguf-py -> HF-equivalent Llama weights).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from kvabi.models.checkpoint import Checkpoint, parse_dtype
from kvabi.models.config import ModelConfig, RopeScaling
from kvabi.models.errors import CheckpointError, MissingFieldError, UnknownArchitectureError
from kvabi.models.gemma3_config import FULL, SLIDING, Gemma3Config, default_layer_types
from kvabi.models.rope import fit_llama3_scaling

# architecture -> whether convert_hf_to_gguf permuted the Q/K rows
ARCH_QK_PERMUTED = {"llama": True, "qwen2": False, "gemma3": False}
# architectures whose norm weights the converter stored as w + 1
NORM_PLUS_ONE = ("gemma3",)

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four sandwich norms and q/k norms; its ffn_norm is the pre-feedforward norm
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_BLOCK_NAMES = {"gemma3": _GEMMA3_BLOCK_NAMES}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_MISSING = object()


def open_gguf(path: str | Path) -> GGUFReader:
    """Memory-map a GGUF file; a missing or unreadable file raises with its path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e


def metadata(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise MissingFieldError(f"GGUF metadata key {key!r} is missing")
    return default


def architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if arch not in ARCH_QK_PERMUTED:
        raise UnknownArchitectureError(
            f"general.architecture {arch!r} is not supported; supported: {sorted(ARCH_QK_PERMUTED)}"
        )
    return arch


def read_config(reader: GGUFReader) -> ModelConfig | Gemma3Config:
    arch = architecture(reader)
    if arch == "gemma3":
        return read_gemma3_config(reader)
    names = {t.name for t in reader.tensors}

    def meta(key: str, default: Any = _MISSING) -> Any:
        return metadata(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    head_dim = meta("attention.key_length", meta("rope.dimension_count", hidden // num_heads))
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(
            f"{arch}.rope.dimension_count: partial rotary embeddings not supported"
        )
    theta = float(meta("rope.freq_base", 10000.0))
    return ModelConfig(
        vocab_size=meta("vocab_size", None) or _vocab_size(reader),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=num_heads,
        num_kv_heads=_uniform(meta("attention.head_count_kv", num_heads), "head_count_kv"),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=meta("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_end_of_generation_ids(reader),
        architecture=arch,
    )


def read_gemma3_config(reader: GGUFReader) -> Gemma3Config:
    """gemma3.* metadata -> Gemma3Config, as transformers' GGUF loader reads it. Not in the file
    and taken as both transformers and llama.cpp do: every 6th layer full (unless the file has a
    per-layer `attention.sliding_window_pattern`), sliding RoPE theta 10000, and scores scaled
    by key_length ** -0.5 (llama.cpp's choice for all sizes but 27B; 256 on 270M either way)."""

    def meta(key: str, default: Any = _MISSING) -> Any:
        return metadata(reader, f"gemma3.{key}", default)

    num_layers, head_dim = meta("block_count"), meta("attention.key_length")
    if meta("attention.value_length", head_dim) != head_dim:
        raise CheckpointError("gemma3.attention.value_length: must equal attention.key_length")
    theta = float(meta("rope.freq_base", 1_000_000.0))
    layer_types = _gemma3_layer_types(meta("attention.sliding_window_pattern", None), num_layers)
    return Gemma3Config(
        vocab_size=_vocab_size(reader),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_layers=num_layers,
        num_heads=meta("attention.head_count"),
        num_kv_heads=_uniform(meta("attention.head_count_kv"), "head_count_kv"),
        head_dim=head_dim,
        layer_types=layer_types,
        sliding_window=meta("attention.sliding_window") if SLIDING in layer_types else None,
        query_pre_attn_scalar=float(head_dim),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, "gemma3", head_dim, theta),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=meta("context_length"),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        final_logit_softcapping=meta("final_logit_softcapping", None),
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_end_of_generation_ids(reader, ("<end_of_turn>",)),
    )


def _gemma3_layer_types(pattern: list[bool] | None, num_layers: int) -> tuple[str, ...]:
    if pattern is None:
        return default_layer_types(num_layers)
    if len(pattern) != num_layers:
        raise CheckpointError(f"gemma3.attention.sliding_window_pattern: {len(pattern)} entries")
    return tuple(SLIDING if is_sliding else FULL for is_sliding in pattern)


def _end_of_generation_ids(reader: GGUFReader, end_tokens: tuple[str, ...] = ()) -> tuple[int, ...]:
    """EOS, plus end-of-turn / end-of-message where given: llama.cpp stops on all of them.
    `end_tokens`: the architecture's end-of-turn spellings, for files without eot_token_id
    (Gemma's `<end_of_turn>`, an EOS of its HF generation_config)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [metadata(reader, f"tokenizer.ggml.{key}", None) for key in keys]
    if end_tokens:
        tokens = metadata(reader, "tokenizer.ggml.tokens", [])
        ids += [tokens.index(t) for t in end_tokens if t in tokens]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _vocab_size(reader: GGUFReader) -> int:
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise MissingFieldError("GGUF tensor 'token_embd.weight' is missing")
    return int(embed.shape[1])  # ggml order: (hidden, vocab)


def _uniform(value: int | list[int], key: str) -> int:
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"attention.{key}: per-layer values {value} are not supported")
        return value[0]
    return value


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        original = metadata(reader, f"{arch}.rope.scaling.original_context_length", 8192)
        factors = dequantize(freqs.data, freqs.tensor_type)
        return fit_llama3_scaling(factors, head_dim, theta, original)
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(metadata(reader, f"{arch}.rope.scaling.factor")))
    raise CheckpointError(
        f"{arch}.rope.scaling.type: {kind!r} not supported; supported: none, linear"
    )


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> the model's parameter name (`LlamaModel`'s, or `arch`'s own)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in block_names:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has no {arch} counterpart")
    layer, kind, suffix = match.groups()
    return f"layers.{layer}.{block_names[kind]}.{suffix}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation (weights [out, in] or biases [out])."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """float32, already in HF [out, in] orientation; a fresh, writable copy of the mmap."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"GGUF tensor {tensor.name!r}: {e}") from e
    return torch.from_numpy(np.array(array, dtype=np.float32))


def load_gguf(
    source: str | Path | GGUFReader, dtype: str | torch.dtype = "fp32", progress: bool = True
) -> Checkpoint:
    """Read a GGUF into a `Checkpoint` whose weights equal the HF model the file came from."""
    reader = source if isinstance(source, GGUFReader) else open_gguf(source)
    config = read_config(reader)
    arch = config.architecture
    torch_dtype = parse_dtype(dtype)
    # Q/K row permutation to undo: tensor kind -> number of heads it holds
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    if not ARCH_QK_PERMUTED[arch]:
        heads = {}
    state_dict: dict[str, torch.Tensor] = {}
    # every name is mapped before any tensor is dequantised: an unknown one loads nothing
    tensors = {hf_name(t.name, arch): t for t in reader.tensors if t.name != _ROPE_FREQS}
    bar = tqdm(tensors.items(), desc="Loading GGUF", unit="tensor", disable=not progress)
    for name, tensor in bar:
        weight = _dequantize(tensor)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            weight = unpermute_qk(weight, heads[kind])
        if arch in NORM_PLUS_ONE and tensor.name.endswith("norm.weight"):
            weight = weight - 1.0
        state_dict[name] = weight.to(torch_dtype)
    return Checkpoint(config, state_dict)
