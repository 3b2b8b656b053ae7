"""One sequence's hybrid cache as kvabi buffers: the convention every engine adapter keeps.

Every owner layer's buffers have the full extent of the sequence's n tokens. A sliding layer of
window W (a query at position t sees keys t - W + 1 .. t) carries KV only at the positions the
next query, at position n, attends to besides itself: `window_start(W, n)` .. n - 1; the
positions before are zeros. Engines keep less (HF: the last W - 1) or more (llama.cpp's SWA
cache: the last W); the adapters map both to exactly this.
"""

from __future__ import annotations

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.kv_groups import window_start
from kvabi.interop.errors import InteropError


def check_windows_held(cache: CacheBuffers, num_tokens: int) -> None:
    """Refuse an unpaged per-layer cache (buffers `'{layer}.k'`, a `T` axis) whose sliding
    layer has no KV (all zeros) at the first position its window needs for a query at
    `num_tokens`: the source kept the window of a longer sequence (e.g. reading back fewer
    tokens than it holds)."""
    axis = cache.desc.layout.axes.index("T")
    for i, spec in enumerate(cache.desc.model.layers):
        first = window_start(spec.window, num_tokens)
        held = first < num_tokens and cache.tensors[f"{i}.k"].select(axis, first).any()
        if spec.window and first < num_tokens and not held:
            raise InteropError(
                f"sliding layer {i} (window {spec.window}) holds no KV at position {first}, "
                f"which a query at position {num_tokens} attends to: the source kept the "
                "window of a longer sequence"
            )
