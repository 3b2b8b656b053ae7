"""`KVStorage`: the engine's KV tensors, in the layout its descriptor names.

The layout is data: any attention preset works (e.g. `vllm-flash-attn` = NHD blocks,
`vllm-flash-attn-hnd` = HND). Readers and writers go through canonical per-layer views
`[block, slot, head, dim]`, so nothing here knows the physical axis order. An MLA model's
layers (DeepSeek) keep their latent (c_kv) as `k` and their RoPE part (k_pe) as `v`, side by
side in one buffer (`vllm-mla`: 576 values per token), whose joint view the attention reads.
DeepSeek V3.2's layers also keep their indexer keys (the sidecar plane `indexer`) in fp8 with a
scale per token, as vLLM stores them (`kvabi/abi/indexer_record.py`); whole-block reads and
writes (prefix cache, tiers, containers) carry them with the latents. DeepSeek V4's compressed
layers (a pool of `centries` layers) keep rows of entries, a block of N tokens holding N / ratio
of them, and per block the compressor's state at its end (`rows`, `states`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvabi.abi.buffers import CacheBuffers, group_views
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, CENTRIES, MLA, STATE, Descriptor
from kvabi.abi.ds_mla_record import ds_mla_records_to_latent_rope, encode_records
from kvabi.abi.indexer_record import SCALE_BYTES, encode_tokens, token_views

DS_MLA = "fp8_ds_mla"


class KVStorage:
    def __init__(self, desc: Descriptor, num_blocks: int) -> None:
        kinds = {x.kind for x in desc.model.layers}
        if len(kinds) != 1 or not kinds <= {ATTN, MLA, CENTRIES}:
            raise ValueError(
                f"kv layout: the engine caches attention (K/V), MLA or compressed-entry layers, "
                f"one kind per storage; got {sorted(kinds)}"
            )
        quant_ok = desc.layout.quant == "none" or (kinds == {MLA} and desc.layout.quant == DS_MLA)
        if not quant_ok or not desc.layout.is_paged:
            raise ValueError(
                f"kv layout: the engine needs a paged layout, unquantised (an MLA model: or "
                f"{DS_MLA} records), got {desc}"
            )
        self.desc = desc
        self.block_size = desc.layout.block_size
        self.buffers = CacheBuffers.empty(desc, num_blocks, "zeros")
        self.entry_desc = desc  # what read_blocks gives (a TP group's rank 0: the whole cache)
        self.k: list[torch.Tensor] = []  # per layer [num_blocks, block_size, num_kv_heads, dim]
        self.v: list[torch.Tensor] = []
        # MLA: per layer [num_blocks, block_size, 1, latent + rope], k its latent, v its rope
        self.joint: list[torch.Tensor] = []
        # DeepSeek V3.2: per layer, its indexer keys' token views (codes [num_blocks,
        # block_size, D] u8, scale bytes [num_blocks, block_size, 4]) in vLLM's block layout
        self.indexers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        # DeepSeek V4 (compressed entries): per layer its rows [num_blocks, rows, 1, width]
        # (entry | index) and its blocks' state records as float32 [num_blocks, floats] or None
        self.rows: list[torch.Tensor] = []
        self.states: list[torch.Tensor | None] = []
        for layer_id in range(desc.model.num_layers):
            groups = group_views(desc, self.buffers.tensors, layer_id)
            if kinds == {CENTRIES}:
                self._add_entries(layer_id, groups)
                continue
            self.indexers.append(self._indexer_views(layer_id))
            if desc.model.layers[layer_id].kind == MLA:
                self._add_mla(layer_id, groups)
                continue
            views = _plane_views(groups)  # a concat layout's K|V split by content offset
            self.k.append(views["k"])
            self.v.append(views["v"])

    def _add_mla(self, layer_id: int, groups: list) -> None:
        """An MLA layer's latent and rope, stored side by side (one `concat` plane group, as
        vLLM's MLA cache): attention reads [latent | rope] as its keys, the latent as values."""
        if len(groups) != 1 or not isinstance(groups[0][1], torch.Tensor):
            raise ValueError(
                f"kv layout {self.desc.layout.name}: MLA layer {layer_id} needs latent and rope "
                "side by side in one strided buffer (planes=concat, e.g. vllm-mla)"
            )
        joint = groups[0][1]
        latent = self.desc.model.layers[layer_id].latent_dim
        self.joint.append(joint)
        if self.is_records:  # u8 records: no per-plane float views; `mla_keys` decodes
            self.k.append(joint)
            self.v.append(joint)
            return
        self.k.append(joint[..., :latent])
        self.v.append(joint[..., latent:])

    def _add_entries(self, layer_id: int, groups: list) -> None:
        if len(groups) != 1 or not isinstance(groups[0][1], torch.Tensor):
            raise ValueError(
                f"kv layout {self.desc.layout.name}: compressed layer {layer_id} needs its "
                "planes side by side in one strided buffer (planes=concat, kvabi-compressed)"
            )
        self.rows.append(groups[0][1])
        state = self.buffers.tensors.get(f"{layer_id}.{STATE}")
        self.states.append(None if state is None else state.view(torch.float32))

    def write_rows(
        self, layer_id: int, block_ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Store a compressed layer's rows [n, width] (entry | index) at (block, row slot)."""
        view = self.rows[layer_id]
        view[block_ids, slots] = rows[:, None].to(view.dtype)

    def read_rows(self, layer_id: int, block_table: torch.Tensor, num_rows: int) -> torch.Tensor:
        """A sequence's first `num_rows` rows of a compressed layer, [num_rows, width]."""
        return self.rows[layer_id][block_table].flatten(0, 1)[:num_rows, 0]

    def state(self, layer_id: int, block_id: int) -> torch.Tensor:
        """The float32 state record of a compressed layer's block (a view: write to it)."""
        states = self.states[layer_id]
        if states is None:
            raise ValueError(f"kv layout: compressed layer {layer_id} keeps no state")
        return states[block_id]

    def _indexer_views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        planes = self.desc.model.layers[layer_id].sidecar_planes
        if not planes:
            return None
        (plane,) = planes  # ABI 1.3: the indexer is the one sidecar plane
        return token_views(self.buffers.tensors[f"{layer_id}.{plane.name}"], plane.width)

    @property
    def has_indexer(self) -> bool:
        """Whether its layers keep DeepSeek V3.2's indexer keys (the sidecar plane)."""
        return any(x is not None for x in self.indexers)

    def write_indexer(
        self, layer_id: int, block_ids: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """Store new tokens' indexer keys [T, D] at (block_ids[t], slots[t]) as vLLM stores
        them: D fp8 e4m3 codes and a float32 power-of-two scale per token."""
        codes, scale_bytes = self._indexer(layer_id)
        q, scales = encode_tokens(keys)  # [T, D] u8, [T] float32
        codes[block_ids, slots] = q
        scale_bytes[block_ids, slots] = scales.view(torch.uint8).view(-1, SCALE_BYTES)

    def indexer_keys(
        self, layer_id: int, block_table: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """A sequence's first `num_tokens` indexer keys, dequantised: float32 [n, D]."""
        codes, scale_bytes = self._indexer(layer_id)
        q = codes[block_table].flatten(0, 1)[:num_tokens]  # [n, D] u8
        scales = scale_bytes[block_table].flatten(0, 1)[:num_tokens].contiguous()
        return q.view(torch.float8_e4m3fn).float() * scales.view(torch.float32)

    def _indexer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = self.indexers[layer_id]
        if views is None:
            raise ValueError(f"kv layout: layer {layer_id} has no indexer plane")
        return views

    @property
    def is_records(self) -> bool:
        """Whether MLA tokens are stored as vLLM's 656-byte fp8_ds_mla records."""
        return self.desc.layout.quant == DS_MLA

    def mla_keys(
        self, layer_id: int, block_table: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """An MLA layer's [latent | rope] of the blocks `block_table` (any shape of block ids)
        in `dtype`: `[*block_table.shape, block_size, 1, latent + rope]`; records dequantised
        (latent[j] = q[j] * scale[j // 128], rope as stored)."""
        stored = self.joint[layer_id][block_table]
        if not self.is_records:
            return stored.to(dtype)
        latent, rope = ds_mla_records_to_latent_rope(stored)
        return torch.cat((latent, rope), dim=-1).to(dtype)

    @property
    def num_blocks(self) -> int:
        return self.buffers.extent

    @property
    def entry_block_bytes(self) -> int:
        """Bytes of one block as `read_blocks` gives it."""
        return self.buffers.num_bytes // self.num_blocks

    def write(
        self,
        layer_id: int,
        block_ids: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K/V [T, heads, dim] at (block_ids[t], slots[t]); an MLA layer's
        c_kv and k_pe [T, 1, dim] as its stored tokens (records: encoded as vLLM writes them)."""
        if self.is_records:
            values = torch.cat((k, v), dim=-1).float()  # [T, 1, 576]
            self.joint[layer_id][block_ids, slots] = encode_records(values)
            return
        self.k[layer_id][block_ids, slots] = k.to(self.k[layer_id].dtype)
        self.v[layer_id][block_ids, slots] = v.to(self.v[layer_id].dtype)

    def gather(
        self, layer_id: int, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `num_tokens` K and V, each [num_tokens, heads, dim] (an MLA
        layer's: latent and rope)."""
        if self.is_records:
            keys = self.mla_keys(layer_id, block_table, torch.float32).flatten(0, 1)[:num_tokens]
            latent = self.desc.model.layers[layer_id].latent_dim
            return keys[..., :latent], keys[..., latent:]
        k = self.k[layer_id][block_table].flatten(0, 1)[:num_tokens]
        v = self.v[layer_id][block_table].flatten(0, 1)[:num_tokens]
        return k, v

    # Whole blocks, for the prefix cache and its tiers (copy on write, write-down, load back).
    # All go through the ABI's one conversion path; between equal layouts it is a strided copy.

    def read_blocks(self, block_ids: Sequence[int]) -> CacheBuffers:
        """A copy of these blocks in this storage's layout (block i of it is `block_ids[i]`)."""
        n = len(block_ids) * self.block_size
        return convert(self.buffers, self.desc, num_tokens=n, src_block_ids=block_ids)

    def write_blocks(
        self, cache: CacheBuffers, block_ids: Sequence[int], src_ids: Sequence[int] | None = None
    ) -> None:
        """Place `cache`'s first `len(block_ids)` blocks' worth of tokens (any layout of this
        model; with `src_ids`, its blocks `src_ids`) into `block_ids`, converting on the way."""
        n = len(block_ids) * self.block_size
        convert(
            cache, self.desc, num_tokens=n,
            src_block_ids=src_ids, dst_block_ids=block_ids, out=self.buffers,
        )  # fmt: skip

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy whole blocks `src_ids[i]` -> `dst_ids[i]` (copy on write)."""
        n = len(src_ids) * self.block_size
        convert(
            self.buffers,
            self.desc,
            num_tokens=n,
            src_block_ids=src_ids,
            dst_block_ids=dst_ids,
            out=self.buffers,
        )


def _plane_views(groups: list) -> dict[str, torch.Tensor]:
    """Each plane's `[block, slot, head, width]` view, from its group's (planes side by side in
    one group, `concat`, are its content's consecutive parts)."""
    views, start = {}, 0
    for planes, view in groups:
        start = 0
        for plane in planes:
            views[plane.name] = view[..., start : start + plane.width]
            start += plane.width
    return views
