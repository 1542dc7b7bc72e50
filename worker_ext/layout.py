"""The engine's model and KV pool at a width: what a bind changes besides the scheduler's queues.

Width ``d`` at rank ``r``: the weights are views of rank r's shard of the one resident layout (worker_ext.weights,
nothing copied), attention runs r's heads, the row-parallel layers reduce over the group, the KV buffers are viewed
at d (worker_ext.kv_layout) and every user of the engine's allocator gets virtual slots of d carved from its
physical slots (a sub-slot allocator). Width 1 is the DP layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from worker_ext import kv_layout
from worker_ext.sglang_patches import memory_pool, model
from worker_ext.weights import WeightsManager, storage_bytes


class Layout:
    def __init__(
        self,
        layers: list[Any],
        kv_pool: Any,
        allocator: Any,
        parameters: Callable[[], Iterable[torch.Tensor]],
    ) -> None:
        self.layers = layers
        self.dims = model.dims(layers)
        self._parameters = parameters
        self._allocator = allocator
        # the resident layout, once: the weights are reordered and the projections restore stock order from now on
        self.weights = WeightsManager([model.layer_weights(layer) for layer in layers], self.dims)
        for layer in layers:
            model.apply_resident_layout(layer, self.weights.activation_order(1))
        self._row_parallel_dp = {id(layer): model.row_parallel_state(layer) for layer in layers}
        self._kv = memory_pool.KVViews(kv_pool)
        self._sub: kv_layout.SubSlotAllocator | None = None

    def bind(self, width: int, rank: int, group: Any) -> kv_layout.SubSlotAllocator:
        """Rank ``rank`` of a group of ``width``; returns the sub-slot allocator now installed."""
        self.weights.activate(width, rank)
        self._set(width, group)
        self._sub = memory_pool.install_sub_allocator(self._allocator, width)
        return self._sub

    def unbind(self) -> None:
        """Heads, reductions, KV views and allocator back to DP; the weights stay on the shard until
        :meth:`release_weights` (a width change goes straight from one shard to the next)."""
        memory_pool.remove_sub_allocator(self._allocator)
        self._sub = None
        self._set(1, None)

    def release_weights(self) -> None:
        self.weights.release()

    def param_bytes(self) -> int:
        """Bytes over the unique storages behind the model's parameters (must not grow across switches)."""
        return storage_bytes(self._parameters())

    def sub_allocator(self) -> kv_layout.SubSlotAllocator:
        if self._sub is None:
            raise RuntimeError("the engine is not bound: no sub-slot allocator")
        return self._sub

    def sub_available(self) -> int:
        return int(self.sub_allocator().available_size())

    def base_available(self) -> int:
        return int(self.sub_allocator().base.available_size())

    def kv_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self._kv.k, self._kv.v

    def _set(self, width: int, group: Any) -> None:
        for layer in self.layers:
            model.set_width(
                layer,
                self.dims.num_heads,
                self.dims.num_kv_heads,
                width,
                group,
                self._row_parallel_dp[id(layer)],
                self.weights.activation_order(width),
            )
        self._kv.set_width(width)
