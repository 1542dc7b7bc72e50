"""The weights manager: one resident layout of the DP copy of the weights, which every TP width shards in place.

At load, the column-parallel fused weights are reordered once into ``P`` interleaved pieces, where ``P`` is the
finest supported width (:attr:`Dims.pieces`)::

    QKV rows      [q_0 k_0 v_0 | q_1 k_1 v_1 | ... | q_P-1 k_P-1 v_P-1]    (x_p: the p-th of P equal row blocks of x)
    gate_up rows  [g_0 u_0     | g_1 u_1     | ... | g_P-1 u_P-1]

Rank r of width d owns pieces r*P/d .. (r+1)*P/d - 1, one contiguous block of rows: its parameter is a view of that
block and each projection stays one GEMM. The order is undone on the activations instead of the weights, right
after the GEMM (:class:`ActivationOrder`): QKV's output columns by one ``index_select`` into stock [q | k | v],
gate_up's by one strided copy of a transposed view into [gate | up]; everything after the two projections is stock
code. A row permutation of a GEMM's weight only permutes its output columns, so DP mode computes the same values
as stock tp=1 and rank r the same as stock ``--tp d`` (each output column is the same dot product; bit-identical
on the CPU kernels here, tested). Row-parallel layers (o_proj, down_proj) need no reorder: rank r's input columns
are contiguous, a strided column view.

A bind or release only re-points views: nothing is copied or permuted, and the parameter bytes equal stock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Dims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def pieces(self) -> int:
        """The finest width every layer divides by: each supported width divides it, so every rank's shard is a
        contiguous run of pieces."""
        return math.gcd(self.num_heads, self.num_kv_heads, self.intermediate)

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check(self, width: int) -> None:
        for name in ("num_heads", "num_kv_heads", "intermediate"):
            if getattr(self, name) % width:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by width {width}")


def _run(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def qkv_layout(d: Dims) -> torch.Tensor:
    """Resident row order of the fused QKV weight: resident row i holds checkpoint row ``layout[i]``."""
    p, q, kv = d.pieces, d.q_rows, d.kv_rows
    qs, ks = q // p, kv // p
    return torch.cat(
        [torch.cat([_run(i * qs, qs), _run(q + i * ks, ks), _run(q + kv + i * ks, ks)]) for i in range(p)]
    )


def gate_up_layout(d: Dims) -> torch.Tensor:
    """Resident row order of the fused gate_up weight."""
    p, n = d.pieces, d.intermediate
    s = n // p
    return torch.cat([torch.cat([_run(i * s, s), _run(n + i * s, s)]) for i in range(p)])


def megatron_qkv_rows(d: Dims, width: int, rank: int) -> torch.Tensor:
    """Checkpoint rows of rank ``rank``'s Megatron QKV shard, in stock ``--tp width`` order [q_r, k_r, v_r]."""
    q, kv = d.q_rows, d.kv_rows
    qs, ks = q // width, kv // width
    return torch.cat([_run(rank * qs, qs), _run(q + rank * ks, ks), _run(q + kv + rank * ks, ks)])


def megatron_gate_up_rows(d: Dims, width: int, rank: int) -> torch.Tensor:
    """Checkpoint rows of rank ``rank``'s Megatron gate_up shard, in stock order [gate_r, up_r]."""
    n = d.intermediate
    s = n // width
    return torch.cat([_run(rank * s, s), _run(n + rank * s, s)])


def out_order(layout: torch.Tensor, width: int, rank: int, megatron_rows: torch.Tensor) -> torch.Tensor:
    """Column index into the GEMM output of rank ``rank``'s block of ``layout`` that yields ``megatron_rows``'s
    order (the activation un-permute)."""
    n = layout.numel() // width
    block = layout[rank * n : (rank + 1) * n]
    where = torch.full((layout.numel(),), -1, dtype=torch.long)
    where[block] = torch.arange(n)
    idx = where[megatron_rows]
    assert bool((idx >= 0).all()) and idx.numel() == n, "the block does not hold the rank's Megatron shard"
    return idx


@dataclass(frozen=True)
class ActivationOrder:
    """How a rank at one width undoes the resident layout on its GEMM outputs, back to stock column order (so
    everything after the two projections is stock code): QKV by one gather, gate_up by one strided copy."""

    qkv: torch.Tensor | None  # index_select order of the QKV output columns (None: already stock order)
    gate_up_pieces: int  # pieces in the rank's gate_up block (1: already stock order)

    def qkv_out(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.qkv is None else y.index_select(-1, self.qkv)

    def gate_up_out(self, y: torch.Tensor) -> torch.Tensor:
        """[g_0 u_0 | g_1 u_1 | ...] -> [g_0 g_1 ... | u_0 u_1 ...]: a transpose of a view, one copy."""
        if self.gate_up_pieces == 1:
            return y
        return y.unflatten(-1, (self.gate_up_pieces, 2, -1)).transpose(-3, -2).reshape(y.shape)


def _permute_rows_(w: torch.Tensor, order: torch.Tensor) -> None:
    w.copy_(w.index_select(0, order.to(w.device)))


class LayerParams(Protocol):
    """One decoder layer's four sharded weights as the model holds them; the model's side is SGLang's
    (worker_ext.sglang_patches.model.LayerWeights), so only the seam writes SGLang's parameters."""

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors the layer computes with now: QKV, o, gate_up, down."""
        ...

    def point(self, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Make the layer compute with these (views of the resident weights)."""
        ...


class WeightsManager:
    """Owns the resident layout; points every layer at the DP weights (width 1) or rank r's shard at width d."""

    def __init__(self, layers: list[LayerParams], dims: Dims) -> None:
        """Reorders the fused weights into the resident layout, in place (once, at load; one layer's temporary at
        a time). The model's forward must undo it on the activations from then on (:meth:`activation_order`)."""
        self.layers, self.dims = layers, dims
        self.qkv_layout, self.gate_up_layout = qkv_layout(dims), gate_up_layout(dims)
        self.full = [lw.tensors() for lw in layers]
        for qkv, _, gate_up, _ in self.full:
            if qkv.shape[0] != self.qkv_layout.numel() or gate_up.shape[0] != self.gate_up_layout.numel():
                raise ValueError(f"the model's fused QKV / gate_up rows do not match its dims {dims}")
            _permute_rows_(qkv, self.qkv_layout)
            _permute_rows_(gate_up, self.gate_up_layout)
        self.width, self.rank = 1, 0
        self._orders: dict[int, ActivationOrder] = {}

    def activation_order(self, width: int) -> ActivationOrder:
        """How a rank at ``width`` restores stock column order on its QKV and gate_up outputs (the same for every
        rank: each rank's block has the same structure)."""
        if width not in self._orders:
            d = self.dims
            d.check(width)
            qkv = out_order(self.qkv_layout, width, 0, megatron_qkv_rows(d, width, 0))
            identity = torch.equal(qkv, torch.arange(qkv.numel()))
            qkv = qkv.to(self.full[0][0].device) if self.full else qkv
            self._orders[width] = ActivationOrder(None if identity else qkv, d.pieces // width)
        return self._orders[width]

    def activate(self, width: int, rank: int) -> None:
        """Point every layer at rank ``rank``'s shard at ``width`` (1: the full DP weights). Views only."""
        if width == self.width and rank == self.rank:
            return
        self.dims.check(width)
        if not 0 <= rank < width:
            raise ValueError(f"rank {rank} outside width {width}")
        qkv_rows, gu_rows = self.qkv_layout.numel() // width, self.gate_up_layout.numel() // width
        o_cols, down_cols = self.dims.q_rows // width, self.dims.intermediate // width
        for lw, (qkv, o, gu, down) in zip(self.layers, self.full):
            lw.point(
                qkv[rank * qkv_rows : (rank + 1) * qkv_rows],
                o[:, rank * o_cols : (rank + 1) * o_cols],
                gu[rank * gu_rows : (rank + 1) * gu_rows],
                down[:, rank * down_cols : (rank + 1) * down_cols],
            )
        self.width, self.rank = width, rank

    def release(self) -> None:
        self.activate(1, 0)


def storage_bytes(tensors) -> int:
    """Bytes over the unique storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
