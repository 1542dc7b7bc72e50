"""The token split and the all-to-alls of a sequence-parallel step (worker_ext.sequence_parallel), with the
members run as threads over an in-process exchange (the gloo/NCCL path is exercised end to end)."""

from __future__ import annotations

import threading

import pytest
import torch

from worker_ext.sequence_parallel import (
    StepMode,
    TokenSplit,
    choose_mode,
    gather_tokens,
    heads_of_all_tokens,
    tokens_of_all_heads,
)


class ThreadGroup:
    """``width`` members in threads of one process: each collective is a mailbox exchange between barriers."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.barrier = threading.Barrier(width)
        self.box: dict[tuple[int, int], torch.Tensor] = {}

    def member(self, rank: int) -> Member:
        return Member(self, rank)


class Member:
    def __init__(self, g: ThreadGroup, rank: int) -> None:
        self.g, self.rank = g, rank

    def all_to_all(self, out, inp, out_splits, in_splits):
        for j, rows in enumerate(inp.split(in_splits)):
            self.g.box[(self.rank, j)] = rows.clone()
        self.g.barrier.wait()
        out.copy_(torch.cat([self.g.box[(i, self.rank)] for i in range(self.g.width)]))
        self.g.barrier.wait()

    def all_gather(self, out, inp):
        self.g.box[(self.rank, -1)] = inp.clone()
        self.g.barrier.wait()
        for i in range(self.g.width):
            out[i].copy_(self.g.box[(i, -1)])
        self.g.barrier.wait()


def run(width: int, fn):
    g, results, errors = ThreadGroup(width), [None] * width, []

    def body(r):
        try:
            results[r] = fn(r, g.member(r))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            g.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    return results


@pytest.mark.parametrize(("total", "width"), [(8, 2), (7, 2), (13, 4), (4, 4), (5, 4)])
def test_split_covers_every_token_once_in_order(total, width):
    split = TokenSplit(total, width)
    bounds = [split.bounds(r) for r in range(width)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert sum(split.sizes()) == total and max(split.sizes()) == split.chunk


@pytest.mark.parametrize(("total", "width"), [(8, 2), (7, 2), (13, 4), (5, 4)])
def test_each_member_gets_every_token_of_its_heads_and_back(total, width):
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 4, 3
    q = torch.randn(total, heads * dim)
    k, v = torch.randn(total, kv_heads * dim), torch.randn(total, kv_heads * dim)
    split = TokenSplit(total, width)

    def member(r, group):
        lo, hi = split.bounds(r)
        mine = heads_of_all_tokens([q[lo:hi], k[lo:hi], v[lo:hi]], split, r, group)
        back = tokens_of_all_heads(mine[0], split, r, group)
        whole = gather_tokens(back, split, group)
        return mine, back, whole

    qs, ks = heads * dim // width, kv_heads * dim // width
    for r, (mine, back, whole) in enumerate(run(width, member)):
        lo, hi = split.bounds(r)
        assert torch.equal(mine[0], q[:, r * qs : (r + 1) * qs])  # this member's query heads, every token
        assert torch.equal(mine[1], k[:, r * ks : (r + 1) * ks]) and torch.equal(
            mine[2], v[:, r * ks : (r + 1) * ks]
        )
        assert torch.equal(back, q[lo:hi])  # its tokens again, every head in order
        assert torch.equal(whole, q)


def test_the_leader_chooses_sp_for_large_prefill_steps_only():
    assert choose_mode(512, 2, 256) is StepMode.SP  # a prefill, or a decode step of 512 sequences
    assert choose_mode(255, 2, 256) is StepMode.TP
    assert choose_mode(4096, 2, 0) is StepMode.TP  # SP off
    assert choose_mode(3, 4, 1) is StepMode.TP  # fewer tokens than members
