"""The SGLang memory-pool internals a bind touches (pinned: ``SUPPORTED_SGLANG``): the token allocator a sub-slot
allocator is installed over, request rows of ``req_to_token``, and the KV buffers' per-width views."""

from __future__ import annotations

from typing import Any

import torch

from worker_ext import kv_layout
from worker_ext.sglang_patches import require


class BaseAllocator:
    """The engine allocator's own methods, as the base of a sub-slot allocator. Physical slots go back at once,
    not into a pending free group: that group is flushed through the (sub-slot) ``free`` it sees."""

    def __init__(self, allocator: Any) -> None:
        cls = type(allocator)
        require(
            all(callable(getattr(cls, n, None)) for n in ("alloc", "free", "available_size")), "allocator API"
        )
        self._allocator, self._free = allocator, cls.free
        self.alloc = cls.alloc.__get__(allocator)
        self.available_size = cls.available_size.__get__(allocator)

    def free(self, index: torch.Tensor) -> None:
        a = self._allocator
        group, a.free_group = a.free_group, None
        try:
            self._free(a, index)
        finally:
            a.free_group = group


_SWAPPED = ("alloc", "free", "available_size")


def install_sub_allocator(
    allocator: Any, width: int, sub: kv_layout.SubSlotAllocator | None = None
) -> kv_layout.SubSlotAllocator:
    """Every user of the engine's allocator (scheduler, tree cache, batches) now gets virtual slots of ``width``
    (``sub``: an allocator of that width installed before, whose slots are still in use: a resume)."""
    if sub is None:
        sub = kv_layout.SubSlotAllocator(BaseAllocator(allocator), width)
    elif sub.width != width:
        raise ValueError(f"a sub-slot allocator of width {sub.width} cannot serve width {width}")
    allocator.alloc, allocator.free, allocator.available_size = sub.alloc, sub.free, sub.available_size
    return sub


def remove_sub_allocator(allocator: Any) -> None:
    for name in _SWAPPED:
        allocator.__dict__.pop(name, None)


def alloc_row(scheduler: Any) -> int:
    got = scheduler.req_to_token_pool.alloc_rows(1)
    if not got:
        raise RuntimeError("out of request rows")
    return got[0]


def free_row(scheduler: Any, row: int) -> None:
    scheduler.req_to_token_pool.free_rows([row])


def write_row(scheduler: Any, row: int, slots: torch.Tensor, start: int = 0) -> None:
    """Positions ``start ..`` of request row ``row`` live in ``slots``."""
    scheduler.req_to_token_pool.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)


class KVViews:
    """The KV pool's per-layer buffers, viewed at a width (worker_ext.kv_layout.view); width 1 is the DP layout."""

    def __init__(self, pool: Any) -> None:
        require(isinstance(getattr(pool, "k_buffer", None), list), "KV pool without per-layer k_buffer")
        self.pool = pool
        self.full = (list(pool.k_buffer), list(pool.v_buffer))
        self.dims = {n: getattr(pool, n) for n in ("head_num", "row_dim", "v_row_dim") if hasattr(pool, n)}

    def set_width(self, width: int) -> None:
        for name, full in self.dims.items():  # per-token row sizes the store kernels use (CUDA path)
            setattr(self.pool, name, full // width)
        self.pool.k_buffer[:] = [kv_layout.view(b, width) for b in self.full[0]]
        self.pool.v_buffer[:] = [kv_layout.view(b, width) for b in self.full[1]]

    @property
    def k(self) -> list[torch.Tensor]:
        return self.pool.k_buffer

    @property
    def v(self) -> list[torch.Tensor]:
        return self.pool.v_buffer
