"""Sequence-parallel (Ulysses) steps inside a bound group: the token split and the two all-to-alls.

In an SP step every member of a group of width ``d`` runs its contiguous slice of the step's tokens
(:class:`TokenSplit`) through its *full* resident weights (the DP view of the one layout: nothing copied). Around
attention, two all-to-alls change what a member holds::

    before attention   member r: its tokens, every head        [T_r, (Hq + 2 Hkv) D]
    all-to-all         member r: every token, its heads         [T, (Hq + 2 Hkv) D / d]   (heads_of_all_tokens)
    attention          against member r's TP KV view: the KV written lands in the TP layout, as in a TP step
    all-to-all         member r: its tokens, every head's output [T_r, Hq D]              (tokens_of_all_heads)

Member r's heads are the r-th of ``d`` equal blocks of the query heads and of the KV heads: exactly the heads its
TP shard and its TP KV view hold, so SP and TP steps read and write the same KV. After the last layer the members
all-gather the hidden states (:func:`gather_tokens`), so the logits and sampling run as in any step.

The collectives go over the group's data communicator (gloo on CPU, NCCL on GPU; worker_ext.comm_pool), through
the small :class:`Collectives` protocol so the arithmetic here is tested without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch


class StepMode(Enum):
    """How a bound group runs one forward."""

    TP = "tp"  # every member: every token, its shard of the weights, two all-reduces per layer
    SP = "sp"  # every member: its slice of the tokens, the full weights, two all-to-alls per layer


def choose_mode(tokens: int, width: int, threshold: int) -> StepMode:
    """The leader's choice for a step, as Shift Parallelism's: SP for a step of at least ``threshold`` batched
    tokens (a prefill or mixed step's tokens, a decode step's sequences; 0: never), TP for small steps."""
    if threshold > 0 and tokens >= max(threshold, width):
        return StepMode.SP
    return StepMode.TP


@dataclass(frozen=True)
class TokenSplit:
    """Contiguous slices of ``total`` tokens over ``width`` members, balanced: the first ``total % width`` members get
    one token more (with ``total >= width`` every member has at least one)."""

    total: int
    width: int

    @property
    def chunk(self) -> int:
        return -(-self.total // self.width)

    def bounds(self, rank: int) -> tuple[int, int]:
        base, extra = divmod(self.total, self.width)
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (1 if rank < extra else 0)

    def sizes(self) -> list[int]:
        return [hi - lo for lo, hi in (self.bounds(r) for r in range(self.width))]


class Collectives(Protocol):
    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        """Rows ``in_splits[j]`` of ``inp`` (in order) go to rank j; ``out`` receives ``out_splits[i]`` rows from
        rank i, in rank order."""
        ...

    def all_gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        """Every rank's ``inp`` (all the same shape), by rank, into ``out``."""
        ...


def pack_heads(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """``parts``: tensors ``[T_r, width * c_i]`` (head blocks in rank order). Returns ``[width * T_r, sum c_i]``:
    the rows for rank j are rank j's block of every part, side by side."""
    t = parts[0].shape[0]
    blocks = [p.reshape(t, width, p.shape[-1] // width) for p in parts]
    return torch.cat(blocks, dim=-1).transpose(0, 1).reshape(width * t, -1)


def heads_of_all_tokens(
    parts: list[torch.Tensor], split: TokenSplit, rank: int, group: Collectives
) -> list[torch.Tensor]:
    """Member ``rank``'s tokens with every head (``parts``: e.g. q, k, v, each ``[T_r, width * c_i]``) ->
    every token with member ``rank``'s heads (each ``[T, c_i]``), in token order."""
    d = split.width
    widths = [p.shape[-1] // d for p in parts]
    inp = pack_heads(parts, d)
    out = torch.empty((split.total, sum(widths)), dtype=inp.dtype, device=inp.device)
    t_r = split.sizes()[rank]
    group.all_to_all(out, inp, split.sizes(), [t_r] * d)
    return list(out.split(widths, dim=-1))


def tokens_of_all_heads(y: torch.Tensor, split: TokenSplit, rank: int, group: Collectives) -> torch.Tensor:
    """Every token with member ``rank``'s heads (``[T, c]``) -> member ``rank``'s tokens with every member's heads
    in rank order (``[T_r, width * c]``)."""
    d, t_r = split.width, split.sizes()[rank]
    out = torch.empty((d * t_r, y.shape[-1]), dtype=y.dtype, device=y.device)
    group.all_to_all(out, y.contiguous(), [t_r] * d, split.sizes())
    c = y.shape[-1]
    return out.reshape(d, t_r, c).transpose(0, 1).reshape(t_r, d * c)


def gather_tokens(x: torch.Tensor, split: TokenSplit, group: Collectives) -> torch.Tensor:
    """Every member's ``[T_r, ...]`` slice -> the whole ``[T, ...]`` (padded to equal slices for the gather)."""
    chunk = split.chunk
    padded = x.new_zeros((chunk, *x.shape[1:]))
    padded[: x.shape[0]] = x
    got = [torch.empty_like(padded) for _ in range(split.width)]
    group.all_gather(got, padded)
    return torch.cat([g[:n] for g, n in zip(got, split.sizes())])


class SPStep:
    """One bound member's SP context: its group's collectives, its rank and width, and the token split of the
    step running now (set when the decoder stack is entered, read by every layer's attention)."""

    def __init__(self, group: Collectives, rank: int, width: int) -> None:
        self.group, self.rank, self.width = group, rank, width
        self.split = TokenSplit(width, width)

    def begin(self, total: int) -> tuple[int, int]:
        """A step of ``total`` tokens starts: this member's slice."""
        if total < self.width:
            raise ValueError(f"an SP step needs at least {self.width} tokens, got {total}")
        self.split = TokenSplit(total, self.width)
        return self.split.bounds(self.rank)

    def heads_of_all_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = heads_of_all_tokens([q, k, v], self.split, self.rank, self.group)
        return q, k, v

    def tokens_of_all_heads(self, y: torch.Tensor) -> torch.Tensor:
        return tokens_of_all_heads(y, self.split, self.rank, self.group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tokens(x, self.split, self.group)
