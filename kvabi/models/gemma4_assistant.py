"""Gemma 4's assistant drafter (HF `Gemma4AssistantForCausalLM`, transformers 5.24) in plain
PyTorch: a small decoder with no K/V of its own that drafts tokens for a Gemma 4 target by
attending to the target's cache.

One draft round, for a sequence whose last token t sits at position P (not yet run through the
target) and whose target hidden state h (after the final norm) is that of position P - 1:
1. x = pre_projection([target_embed(t) | h]): the target's scaled embedding beside h;
2. every assistant layer attends, with its own queries at position P (fixed for all rounds),
   to the K/V the target stored at its *feeding layer* of the same type: the last layer of
   that type before the target's KV-shared layers (HF's `kv_sharing_modes` "store"). A full
   layer reads every key before P, a sliding one the last `sliding_window + 1` of them;
3. the final norm, then the LM head (or, with `use_ordered_embeddings`, the head over the
   top centroids' tokens only) gives the draft token; `post_projection` of the normed state is
   the h of the next round, whose t is the token just drafted.

The layers are Gemma 4's (q norm, RoPE per layer type, attention scale 1, four sandwich
norms, gelu-tanh MLP, `layer_scalar`) without k/v projections, PLE or MoE. Parameter names
equal HF's without `model.`. The keys passed in are the target's after k norm and RoPE, the
values after v norm: what its paged cache holds.

Where HF's loop differs: after a verification that rejected draft tokens, HF passes the
target's K/V of the verified forward cut to the new length, so the full layers see one key
of a rejected draft (at P) and the sliding layers all of them; kvabi gives the assistant only
keys of accepted tokens (before P), which is what HF passes after a prefill and after a
verification that accepted the whole draft. Drafts are greedy (argmax), as in HF.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvabi.models.errors import CheckpointError
from kvabi.models.gemma4 import Gemma4MLP, Gemma4RMSNorm, rotaries
from kvabi.models.gemma4_config import Gemma4Config, read_gemma4_config
from kvabi.models.rope import apply_rope


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    """`text` is the assistant's decoder, read as if no layer shared K/V (it owns none: every
    layer reads the target's); `backbone_hidden_size` the target's hidden size."""

    text: Gemma4Config
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32


def read_gemma4_assistant_config(raw: Mapping[str, Any]) -> Gemma4AssistantConfig:
    """config.json of `gemma4_assistant` -> `Gemma4AssistantConfig` (CheckpointError where
    HF's own validation would refuse it, or kvabi does not run it)."""
    if raw.get("model_type") != "gemma4_assistant":
        raise CheckpointError(f"model_type {raw.get('model_type')!r} is not 'gemma4_assistant'")
    text = dict(raw["text_config"])
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            raise CheckpointError(f"gemma4_assistant: {key} must be 0, got {text[key]}")
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if text.get(key):
            raise CheckpointError(f"gemma4_assistant: {key} must be false")
    num_layers = text["num_hidden_layers"]
    if text.get("num_kv_shared_layers", num_layers) != num_layers:
        raise CheckpointError("gemma4_assistant: every layer must share the target's K/V")
    text.update(num_kv_shared_layers=0, hidden_size_per_layer_input=0)
    text.update(vocab_size_per_layer_input=0, tie_word_embeddings=True)
    config = Gemma4AssistantConfig(
        read_gemma4_config(text),
        raw.get("backbone_hidden_size", 1536),
        bool(raw.get("use_ordered_embeddings", False)),
        raw.get("num_centroids", 2048),
        raw.get("centroid_intermediate_top_k", 32),
    )
    if config.use_ordered_embeddings and (
        config.text.vocab_size % config.num_centroids
        or not 0 < config.centroid_intermediate_top_k <= config.num_centroids
    ):
        raise CheckpointError(
            "gemma4_assistant: num_centroids must divide vocab_size and top_k be in "
            f"[1, num_centroids], got {config.num_centroids}, {config.centroid_intermediate_top_k}"
        )
    return config


def feeding_layers(target: Gemma4Config) -> dict[str, int]:
    """Per layer type, the target layer whose K/V the assistant's layers of that type read."""
    modes = target.kv_sharing_modes()
    return {target.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


def check_pairing(assistant: Gemma4AssistantConfig, target: Gemma4Config) -> None:
    """CheckpointError unless the assistant was built for a target of this shape: its
    backbone hidden size and vocabulary, and per layer type the feeding layer's KV heads and
    head dim."""
    a, feeding = assistant.text, feeding_layers(target)
    if assistant.backbone_hidden_size != target.hidden_size:
        raise CheckpointError(
            f"assistant: backbone_hidden_size {assistant.backbone_hidden_size} != the target's "
            f"hidden_size {target.hidden_size}"
        )
    if a.vocab_size != target.vocab_size:
        raise CheckpointError(f"assistant: vocab {a.vocab_size} != target's {target.vocab_size}")
    for i, layer_type in enumerate(a.layer_types):
        if layer_type not in feeding:
            raise CheckpointError(f"assistant layer {i}: the target has no {layer_type} layer")
        src = feeding[layer_type]
        mine = (a.layer_kv_heads(i), a.layer_head_dim(i))
        theirs = (target.layer_kv_heads(src), target.layer_head_dim(src))
        if mine != theirs:
            raise CheckpointError(
                f"assistant layer {i} ({layer_type}): (kv heads, head dim) {mine} != target "
                f"layer {src}'s {theirs}"
            )


@dataclass(frozen=True)
class SharedKV:
    """One layer type's K/V from the target for a batch of drafting sequences: keys and values
    [B, L, kv_heads, head_dim] (padded), `valid` [B, L] the keys each sequence attends to."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor


class AssistantAttention(nn.Module):
    def __init__(self, config: Gemma4Config, layer_id: int) -> None:
        super().__init__()
        self.head_dim = head_dim = config.layer_head_dim(layer_id)
        hidden, heads = config.hidden_size, config.num_heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.q_norm = Gemma4RMSNorm(head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SharedKV
    ) -> torch.Tensor:
        """x [B, hidden] -> [B, hidden]; scale 1 (q is RMS-normed), keys repeated per group."""
        b = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, -1, self.head_dim)), cos, sin)
        group = q.shape[1] // kv.keys.shape[2]
        keys = kv.keys.to(q.dtype).repeat_interleave(group, dim=2)  # [B, L, heads, d]
        values = kv.values.to(q.dtype).repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,blhd->bhl", q, keys).float()
        scores = scores.masked_fill(~kv.valid[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.einsum("bhl,blhd->bhd", weights, values)
        return self.o_proj(out.reshape(b, -1))


class AssistantLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_id]
        self.self_attn = AssistantAttention(config, layer_id)
        self.mlp = Gemma4MLP(hidden, config.intermediate_size)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SharedKV
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class MaskedEmbedding(nn.Module):
    """`use_ordered_embeddings`: logits only for the tokens of the top centroids (the rest
    get the smallest computed logit minus 1, as HF)."""

    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        vocab = config.text.vocab_size
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.centroids = nn.Linear(config.text.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))

    def forward(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """h [B, hidden], head [vocab, hidden] -> logits [B, vocab]."""
        top = self.centroids(h).topk(self.top_k, dim=-1).indices  # [B, top_k]
        tokens = self.token_ordering.view(self.num_centroids, -1)[top].flatten(1)  # [B, n]
        picked = torch.einsum("bd,bnd->bn", h, head[tokens])
        out = torch.full((h.shape[0], head.shape[0]), picked.min().item() - 1.0, dtype=h.dtype)
        return out.scatter_(1, tokens, picked)


class Gemma4Assistant(nn.Module):
    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.config = config
        text, hidden = config.text, config.text.hidden_size
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, config.backbone_hidden_size, bias=False)
        self.layers = nn.ModuleList(AssistantLayer(text, i) for i in range(text.num_layers))
        self.norm = Gemma4RMSNorm(hidden, text.rms_norm_eps)
        self.embed_tokens = nn.Embedding(text.vocab_size, hidden)  # the LM head (tied)
        self.rotary = rotaries(text)
        self.masked_embedding = MaskedEmbedding(config) if config.use_ordered_embeddings else None

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.config.text.layer_types

    def window(self, layer_type: str) -> int:
        """Keys before P a layer of this type attends to, at most (0: all of them)."""
        if layer_type != "sliding_attention":
            return 0
        return (self.config.text.sliding_window or 0) + 1

    def forward(
        self, inputs: torch.Tensor, positions: torch.Tensor, shared: Mapping[str, SharedKV]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One round: inputs [B, 2 * backbone] (target embedding | target-space hidden),
        positions [B] -> (next target-space hidden [B, backbone], logits [B, vocab])."""
        x = self.pre_projection(inputs)
        tables = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, *tables[layer.layer_type], shared[layer.layer_type])
        h = self.norm(x)
        head = self.embed_tokens.weight
        logits = h @ head.T if self.masked_embedding is None else self.masked_embedding(h, head)
        return self.post_projection(h), logits

    @torch.inference_mode()
    def draft(
        self,
        target_embed: nn.Module,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        shared: Mapping[str, SharedKV],
        num_draft: int,
    ) -> torch.Tensor:
        """`num_draft` greedy rounds for B sequences: token_ids [B] their last tokens, hidden
        [B, backbone] the target's normed hidden state before them, positions [B] those
        tokens' positions -> draft tokens [B, num_draft]."""
        ids, drafts = token_ids, []
        for _ in range(num_draft):
            inputs = torch.cat([target_embed(ids).to(hidden.dtype), hidden], dim=-1)
            hidden, logits = self(inputs, positions, shared)
            ids = logits.argmax(dim=-1)
            drafts.append(ids)
        return torch.stack(drafts, dim=1)


def _weight_name(hf_name: str, tied: bool) -> str | None:
    """HF name -> ours: `model.` dropped; an untied `lm_head` is our head (`embed_tokens`,
    which the assistant never looks tokens up in: its inputs are the target's embeddings)."""
    if hf_name == "lm_head.weight":
        return None if tied else "embed_tokens.weight"
    if hf_name == "model.embed_tokens.weight" and not tied:
        return None
    return hf_name.removeprefix("model.")


def load_gemma4_assistant(
    folder: str | Path, target: Gemma4Config, dtype: torch.dtype = torch.float32
) -> Gemma4Assistant:
    """An HF `gemma4_assistant` folder -> `Gemma4Assistant` for `target` (CheckpointError if
    the two do not pair, or a weight is missing or unexpected)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    config, tied = read_gemma4_assistant_config(raw), raw.get("tie_word_embeddings", True)
    check_pairing(config, target)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"assistant: no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            ours = _weight_name(name, tied)
            if ours is not None:
                tensors[ours] = tensor
    model = Gemma4Assistant(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"assistant: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()
