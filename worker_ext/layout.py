"""The engine's model and KV pool at a width: what a bind changes besides the scheduler's queues.

Width ``d`` at rank ``r``: the weights are views of rank r's shard of the one resident layout (worker_ext.weights,
nothing copied), attention runs r's heads, the row-parallel layers reduce over the group, the KV buffers are viewed
at d (worker_ext.kv_layout) and every user of the engine's allocator gets virtual slots of d carved from its
physical slots (a sub-slot allocator). Width 1 is the DP layout.

While bound, each step runs in one of two modes (:class:`~worker_ext.sequence_parallel.StepMode`): TP (the
shard view of the weights, all-reduces over the group) or SP (the full view, this member's slice of the tokens,
all-to-alls around attention). Both read and write the same TP KV view; switching is re-pointing views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from worker_ext import kv_layout
from worker_ext.sequence_parallel import SPStep, StepMode
from worker_ext.sglang_patches import memory_pool, model
from worker_ext.weights import WeightsManager, storage_bytes


class Layout:
    def __init__(
        self,
        layers: list[Any],
        kv_pool: Any,
        allocator: Any,
        parameters: Callable[[], Iterable[torch.Tensor]],
        stack: Any = None,
    ) -> None:
        """``stack``: the decoder stack (embeddings, layers, final norm) an SP step slices the tokens of."""
        self.layers = layers
        self._stack = stack
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
        self._sp: SPStep | None = None  # while bound: the group, this member's rank and the width
        self.mode = StepMode.TP

    def bind(
        self, width: int, rank: int, group: Any, sub: kv_layout.SubSlotAllocator | None = None
    ) -> kv_layout.SubSlotAllocator:
        """Rank ``rank`` of a group of ``width``; returns the sub-slot allocator now installed (``sub``: a parked
        epoch's, at the same width, whose slots hold its requests' KV: a resume)."""
        self.weights.activate(width, rank)
        self._set(width, group)
        self._sub = memory_pool.install_sub_allocator(self._allocator, width, sub)
        self._sp, self.mode = SPStep(group, rank, width), StepMode.TP
        return self._sub

    def step_mode(self, mode: StepMode) -> None:
        """Bound: run the next forward in ``mode`` (views re-pointed, nothing copied)."""
        if mode is self.mode:
            return
        sp = self._sp
        if sp is None:
            raise RuntimeError("step modes apply to a bound engine only")
        if mode is StepMode.SP and self._stack is None:
            raise RuntimeError("this engine's layout has no decoder stack to run SP steps on")
        dp_state = self._row_parallel_dp
        if mode is StepMode.SP:
            self.weights.activate(1, 0)
            order = self.weights.activation_order(1)
            for layer in self.layers:
                model.set_order(layer, order)
                model.set_row_parallel(layer, None, dp_state[id(layer)])
                model.apply_sp_attention(layer, sp, self.dims.q_rows, self.dims.kv_rows)
            model.apply_sp_stack(self._stack, sp)
        else:
            self.weights.activate(sp.width, sp.rank)
            order = self.weights.activation_order(sp.width)
            for layer in self.layers:
                model.remove_sp_attention(layer)
                model.set_order(layer, order)
                model.set_row_parallel(layer, sp.group, dp_state[id(layer)])
            model.remove_sp_stack(self._stack)
        self.mode = mode

    def unbind(self) -> None:
        """Heads, reductions, KV views and allocator back to DP; the weights stay on the shard until
        :meth:`release_weights` (a width change goes straight from one shard to the next)."""
        self.step_mode(StepMode.TP)
        self._sp = None
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

    def keep_back(self, n: int) -> None:
        self.sub_allocator().keep_back(n)

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
