"""The weights manager: rank r's Megatron shard of every sharded layer, out of the one DP copy of the weights.

Column-parallel fused layers (QKV, gate_up) are permuted *in place* so that each rank's rows are one contiguous
block ([q_r | k_r | v_r] per rank, [gate_r | up_r] per rank); the bound layer's parameter then points at a view of
its block, and the GEMM runs at native speed. Row-parallel layers (o_proj, down_proj) need no reorder: rank r's
input columns are already contiguous, so the parameter is a strided column view. Release (or a width change)
permutes back, bit-exactly: permutations move values, they never compute. No persistent extra memory: the
permutation's temporary is one layer's weight, freed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int

    def check(self, width: int) -> None:
        for name in ("num_heads", "num_kv_heads", "intermediate"):
            if getattr(self, name) % width:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by width {width}")


def qkv_order(d: Dims, width: int) -> torch.Tensor:
    """Row order of the fused QKV weight that makes each rank's [q_r, k_r, v_r] contiguous."""
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    qs, kvs = q // width, kv // width
    parts = []
    for r in range(width):
        parts += [
            torch.arange(r * qs, (r + 1) * qs),
            torch.arange(q + r * kvs, q + (r + 1) * kvs),
            torch.arange(q + kv + r * kvs, q + kv + (r + 1) * kvs),
        ]
    return torch.cat(parts)


def gate_up_order(d: Dims, width: int) -> torch.Tensor:
    """Row order of the fused gate_up weight that makes each rank's [gate_r, up_r] contiguous."""
    n, s = d.intermediate, d.intermediate // width
    return torch.cat(
        [
            torch.cat([torch.arange(r * s, (r + 1) * s), torch.arange(n + r * s, n + (r + 1) * s)])
            for r in range(width)
        ]
    )


def _permute_rows_(w: torch.Tensor, order: torch.Tensor) -> None:
    w.copy_(w.index_select(0, order.to(w.device)))


@dataclass
class LayerWeights:
    """The four sharded parameters of one decoder layer (anything with a ``.data`` tensor)."""

    qkv: torch.nn.Parameter
    o: torch.nn.Parameter
    gate_up: torch.nn.Parameter
    down: torch.nn.Parameter


class WeightsManager:
    """Switches every layer between the DP layout (width 1) and rank r's shard at width d."""

    def __init__(self, layers: list[LayerWeights], dims: Dims) -> None:
        self.layers, self.dims = layers, dims
        self.full = [(lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data) for lw in layers]
        self.width, self.rank = 1, 0
        self._orders: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _order(self, width: int):
        if width not in self._orders:
            qkv, gu = qkv_order(self.dims, width), gate_up_order(self.dims, width)
            self._orders[width] = (qkv, torch.argsort(qkv), gu, torch.argsort(gu))
        return self._orders[width]

    def activate(self, width: int, rank: int) -> None:
        """Point every layer at rank ``rank``'s shard at ``width`` (1: the full DP weights). A width change goes
        straight from one layout to the other (one permutation per fused weight)."""
        if width == self.width and rank == self.rank:
            return
        self.dims.check(width)
        if not 0 <= rank < width:
            raise ValueError(f"rank {rank} outside width {width}")
        d = self.dims
        if width != self.width:
            undo = self._order(self.width) if self.width > 1 else None
            do = self._order(width) if width > 1 else None
            for qkv, _, gu, _ in self.full:
                for w, i in ((qkv, 0), (gu, 2)):
                    if undo is not None and do is not None:  # compose: new[i] = cur[inv_old[do[i]]]
                        _permute_rows_(w, undo[i + 1][do[i]])
                    elif undo is not None:
                        _permute_rows_(w, undo[i + 1])
                    elif do is not None:
                        _permute_rows_(w, do[i])
        qkv_rows = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim // width
        o_cols = d.num_heads * d.head_dim // width
        gu_rows, down_cols = 2 * d.intermediate // width, d.intermediate // width
        for lw, (qkv, o, gu, down) in zip(self.layers, self.full):
            lw.qkv.data = qkv[rank * qkv_rows : (rank + 1) * qkv_rows]
            lw.o.data = o[:, rank * o_cols : (rank + 1) * o_cols]
            lw.gate_up.data = gu[rank * gu_rows : (rank + 1) * gu_rows]
            lw.down.data = down[:, rank * down_cols : (rank + 1) * down_cols]
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
