"""KV transformation among the members of a group: the plans (pure) and the exchange over a real gloo group of
2 and 4 processes: adopt DP requests into TP slices and scatter them back to their owners, bit-exact."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist

from flying.procs import free_port
from worker_ext import kv_transform
from worker_ext.kv_layout import SubSlotAllocator, view
from worker_ext.kv_transform import Held

H, D, SIZE, LAYERS = 4, 3, 256, 2


def kv_value(owner: int, rid: int, pos: int, layer: int, which: int) -> torch.Tensor:
    """The (H, D) content of token ``pos`` of request ``rid`` (unique per token, head and element)."""
    base = ((owner * 100 + rid) * 1000 + pos) * 10 + layer * 2 + which
    return torch.arange(H * D, dtype=torch.float64).view(H, D) + base * 100


class Allocator:
    """A token allocator like SGLang's (slot 0 reserved), without importing SGLang in the child processes."""

    def __init__(self, size: int) -> None:
        self.free_slots = list(range(1, size + 1))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots += slots.tolist()

    def available_size(self) -> int:
        return len(self.free_slots)


def tree_value(owner: int, pos: int, layer: int, which: int) -> torch.Tensor:
    """The content of position ``pos`` of ``owner``'s cached prefix (its prefix tree's slots)."""
    return kv_value(owner, 99, pos, layer, which)


def _rank(rank: int, width: int, port: int, lengths: dict[int, list[int]], shared: int, errors) -> None:
    """``shared``: every member's requests start with the same ``shared`` tokens, in slots of its prefix tree
    (read in place by an adoption, never carved or moved, intact afterwards)."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("t", store), rank, width, datetime.timedelta(seconds=30)
        )
        alloc = Allocator(SIZE)
        alloc.alloc(7)  # some slots already taken, so slot numbers differ across ranks
        k = [torch.zeros(SIZE + 1, H, D, dtype=torch.float64) for _ in range(LAYERS)]
        v = [torch.zeros(SIZE + 1, H, D, dtype=torch.float64) for _ in range(LAYERS)]
        tree = alloc.alloc(shared)
        for pos, p in enumerate(tree.tolist()):
            for layer in range(LAYERS):
                k[layer][p], v[layer][p] = tree_value(rank, pos, layer, 0), tree_value(rank, pos, layer, 1)
        own = {}
        for i, n in enumerate(lengths[rank]):  # this member's DP requests, full heads in physical slots
            phys = torch.cat((tree, alloc.alloc(n - shared)))
            own[f"{rank}-{i}"] = phys
            for pos, p in enumerate(phys.tolist()[shared:], start=shared):
                for layer in range(LAYERS):
                    k[layer][p] = kv_value(rank, i, pos, layer, 0)
                    v[layer][p] = kv_value(rank, i, pos, layer, 1)
        held = [Held(f"{r}-{i}", r, n, shared) for r in range(width) for i, n in enumerate(lengths[r])]

        def expected(owner: int, i: int, pos: int, layer: int, which: int) -> torch.Tensor:
            return (
                tree_value(owner, pos, layer, which)
                if pos < shared
                else kv_value(owner, i, pos, layer, which)
            )

        def tree_intact() -> None:
            for pos, p in enumerate(tree.tolist()):
                for layer in range(LAYERS):
                    assert torch.equal(k[layer][p], tree_value(rank, pos, layer, 0)), f"tree slot {p} changed"
                    assert torch.equal(v[layer][p], tree_value(rank, pos, layer, 1)), f"tree slot {p} changed"

        sub = SubSlotAllocator(alloc, width)
        kv_views, vv_views = [view(t, width) for t in k], [view(t, width) for t in v]
        ex, slots = kv_transform.plan_adopt(held, rank, width, own, sub.take_over, sub.alloc)
        stats = kv_transform.run_exchange(group, rank, ex, kv_views, vv_views)
        assert stats.tokens == (width - 1) * sum(lengths[rank]), (
            stats
        )  # shared prefixes too: each request's own
        hs = slice(rank * H // width, (rank + 1) * H // width)
        for h in held:  # every request's slice ``rank`` is here now, in this rank's virtual slots
            owner, i = map(int, h.rid.split("-"))
            for pos, slot in enumerate(slots[h.rid].tolist()):
                for layer in range(LAYERS):
                    assert torch.equal(kv_views[layer][slot], expected(owner, i, pos, layer, 0)[hs])
                    assert torch.equal(vv_views[layer][slot], expected(owner, i, pos, layer, 1)[hs])
        tree_intact()
        # scatter: everything back to its owner, as whole physical slots
        dist_free = torch.tensor([alloc.available_size()])
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(width)]
        group.allgather([gathered], [dist_free]).wait()
        free = [int(t.item()) for t in gathered]
        placed = kv_transform.scatter_placement(held, free)
        assert placed == {h.rid for h in held}
        ex, taken = kv_transform.plan_scatter(held, placed, rank, width, slots, alloc.alloc)
        kv_transform.run_exchange(group, rank, ex, kv_views, vv_views)
        for rid, phys in taken.items():
            owner, i = map(int, rid.split("-"))
            assert owner == rank
            for pos, p in enumerate(phys.tolist()):
                for layer in range(LAYERS):
                    assert torch.equal(k[layer][p], expected(owner, i, pos, layer, 0))
                    assert torch.equal(v[layer][p], expected(owner, i, pos, layer, 1))
        tree_intact()
        for (
            h
        ) in held:  # the TP slices are freed: every carved physical slot goes back, the tree keeps its own
            sub.free(slots[h.rid][shared if h.rank == rank else 0 :])
        assert sub.physical_in_use() == 0
        assert not set(tree.tolist()) & set(alloc.free_slots)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.parametrize(
    ("lengths", "shared"),
    [pytest.param({0: [5, 9], 1: [12]}, 0, id="width2"),
     pytest.param({0: [3], 1: [], 2: [17, 1], 3: [8, 8, 2]}, 0, id="width4", marks=pytest.mark.slow),
     pytest.param({0: [5, 9], 1: [12, 4]}, 3, id="width2-cached-prefix", marks=pytest.mark.slow),
     pytest.param({0: [3], 1: [], 2: [17, 2], 3: [8, 8, 2]}, 2, id="width4-cached-prefix", marks=pytest.mark.slow)],
)  # fmt: skip
def test_adopt_then_scatter_moves_head_slices_bit_exactly(lengths, shared):
    """With a cached prefix, several requests of a member share its slots (as SGLang's radix tree shares them)."""
    width, port = len(lengths), free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, width, port, lengths, shared, errors)) for r in range(width)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs)


def test_adopt_fits_counts_the_siblings_a_member_frees():
    held = [Held("a", 0, 10), Held("b", 1, 30)]
    # rank 0 receives 30 slices; it frees 10 siblings of its own at width 2, so it needs 20 more free
    assert kv_transform.adopt_fits(held, [20, 0], 2) == []
    assert kv_transform.adopt_fits(held, [19, 0], 2) == [0]
    assert kv_transform.adopt_fits(held, [0, 40, 40, 40], 4) == []  # 3 x 10 siblings freed at width 4
    assert kv_transform.adopt_fits(held, [0, 40, 39, 40], 4) == [2]
    cached = [Held("a", 0, 10, shared=6), Held("b", 1, 30)]  # only a's 4 own slots free their siblings
    assert kv_transform.adopt_fits(cached, [26, 0], 2) == []
    assert kv_transform.adopt_fits(cached, [25, 0], 2) == [0]


def test_scatter_placement_keeps_order_and_owner_capacity():
    held = [Held("a", 0, 10), Held("b", 0, 10), Held("c", 1, 5), Held("d", 0, 1)]
    assert kv_transform.scatter_placement(held, [15, 5]) == {"a", "c", "d"}  # b does not fit, d still does
