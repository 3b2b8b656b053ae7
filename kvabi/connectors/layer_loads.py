"""`LayerLoads`: a forward's loads into vLLM's cache, a group of layers at a time, on a thread,
so that layer i's attention waits only for layer i's blocks (vLLM's `wait_for_layer_load`).

vLLM calls the connector's `start_load_kv` before a forward and `wait_for_layer_load(layer)`
inside each attention layer. A synchronous load does every layer before the forward starts;
here the loads run on the connector's load thread in groups of `GROUP_LAYERS` layers, in layer
order, and the forward's first layers compute while the later layers' blocks are still being
placed. Nothing of vLLM is imported: the loads are `write_sequence` calls (a
`ReblockPlan` moves one group's layers per call).

The thread's kernel calls use one thread (`limit_threads`): it is meant for a core the
forward's threads leave spare. Where there is none it only contends with them (measured with
vLLM on 2 cores: a 640-token hit's TTFT 95 ms either way with one thread, 130-180 ms with
two), so the connector loads in the background only where a core is spare (`spare_cores`).

A load that fails raises in the wait of every layer it had not placed yet (and in `finish`),
so the forward stops before any attention reads blocks that were not written: the step fails
as a synchronous load's would have. `finish` waits for everything (the end of the step).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvabi.abi.buffers import CacheBuffers, owner_layers
from kvabi.interop.vllm_cache import write_sequence
from kvabi.native.cpu_kernels import limit_threads

GROUP_LAYERS = 4  # layers placed per step of the thread (Python and a kernel call per group)


@dataclass
class Load:
    """Store blocks (`blocks`, in prompt order) to place into vLLM blocks `block_ids` (whole
    vLLM blocks: `ratio` store blocks each)."""

    block_ids: list[int]
    blocks: CacheBuffers


class LayerLoads:
    def __init__(self, group_layers: int = GROUP_LAYERS) -> None:
        self.group_layers = group_layers
        self._thread: ThreadPoolExecutor | None = None
        self._of_layer: dict[int, Future] = {}  # each layer's group, this forward
        self.load_s = 0.0  # the thread's time placing blocks
        self.wait_s = 0.0  # the forward's time waiting for a layer's blocks

    def start(self, loads: Sequence[Load], cache: CacheBuffers, background: bool) -> None:
        """Queue `loads` into `cache` on the thread, layer group by layer group; or, not in
        the `background`, place them all now, on this thread's cores."""
        self.finish()  # a previous forward's, should a step have skipped its end
        if not loads:
            return
        if not background:
            start = time.perf_counter()
            for load in loads:
                write_sequence(load.blocks, cache, load.block_ids, _tokens(load, cache))
            self.load_s += time.perf_counter() - start
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvabi-load")
        layers = owner_layers(cache.desc)
        for lo in range(0, len(layers), self.group_layers):
            group = layers[lo : lo + self.group_layers]
            future = self._thread.submit(self._place, loads, cache, group)
            self._of_layer.update(dict.fromkeys(group, future))

    def wait(self, layer: int) -> None:
        """Return once layer `layer`'s blocks are placed (at once if it had none to load)."""
        future = self._of_layer.get(layer)
        if future is None:
            return
        start = time.perf_counter()
        future.result()  # a failed load raises here, before the layer reads its blocks
        self.wait_s += time.perf_counter() - start

    def finish(self) -> None:
        """Wait for every queued load (the end of a step)."""
        pending, self._of_layer = set(self._of_layer.values()), {}
        for future in pending:
            future.result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _place(self, loads: Sequence[Load], cache: CacheBuffers, group: list[int]) -> None:
        start = time.perf_counter()
        with limit_threads(1):  # the spare core, beside the forward's threads
            for load in loads:
                write_sequence(load.blocks, cache, load.block_ids, _tokens(load, cache), group)
        self.load_s += time.perf_counter() - start


def spare_cores() -> int:
    """Cores this process may run on beyond torch's threads (which a forward keeps busy)."""
    return len(os.sched_getaffinity(0)) - torch.get_num_threads()


def _tokens(load: Load, cache: CacheBuffers) -> int:
    return len(load.block_ids) * cache.desc.layout.block_size
