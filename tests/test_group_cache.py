"""A bound group's prefix cache without workers: the leader's tree over a sub-slot allocator (its frees logged),
and a follower's copies of the leader's slots following the plans (worker_ext.sglang_patches.group_cache,
worker_ext.step_plan)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from tests.fakes import FakeEngine
from worker_ext.kv_layout import SubSlotAllocator
from worker_ext.rank_messages import Forward, Noop
from worker_ext.sglang_patches.group_cache import GroupCache
from worker_ext.step_plan import Shadows, StepPlans


class Base:
    """Physical slots 0 .. n-1."""

    def __init__(self, n: int) -> None:
        self.free_slots = list(range(n))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, index: torch.Tensor) -> None:
        self.free_slots += index.tolist()

    def available_size(self) -> int:
        return len(self.free_slots)


def test_a_leaders_sub_slot_allocator_logs_its_frees_until_taken():
    sub = SubSlotAllocator(Base(8), 2)
    slots = sub.alloc(3)
    assert slots is not None
    sub.free(slots[:1])
    assert sub.take_freed() == []  # not logging
    sub.free_log = []
    sub.free(slots[1:])
    assert sub.take_freed() == slots[1:].tolist()
    assert sub.take_freed() == []
    assert sub.available_size() == 16


def leader_tree(sub: SubSlotAllocator) -> GroupCache:
    allocator = SimpleNamespace(
        device="cpu", free=sub.free, free_segment=lambda index, start_pos: sub.free(index), page_size=1
    )
    scheduler = SimpleNamespace(
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        tree_cache=SimpleNamespace(page_size=1),
        server_args=SimpleNamespace(radix_eviction_policy="lru"),
    )
    return GroupCache(scheduler)


def insert(cache: GroupCache, tokens: list[int], slots: torch.Tensor) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.tree.insert(InsertParams(key=RadixKey(array("q", tokens), extra_key=None), value=slots))


@pytest.mark.filterwarnings("ignore::UserWarning")  # importing SGLang's tree on a CPU host
def test_the_group_tree_evicts_in_virtual_slots_and_its_drop_frees_the_rest():
    sub = SubSlotAllocator(Base(8), 2)
    sub.free_log = []
    cache = leader_tree(sub)
    a, b = sub.alloc(4), sub.alloc(3)
    assert a is not None and b is not None
    insert(cache, [1, 2, 3, 4], a)
    insert(cache, [7, 8, 9], b)
    assert cache.evictable() == 7
    assert cache.evict(3) >= 3
    evicted = sub.take_freed()
    assert len(evicted) == cache.evict(0) + len(evicted) >= 3
    assert cache.drop() == 7 - len(evicted)
    assert sorted(evicted + sub.take_freed()) == sorted(a.tolist() + b.tolist())
    assert sub.physical_in_use() == 0 and cache.evictable() == 0


def follower(kv: int = 100) -> tuple[FakeEngine, Shadows, StepPlans]:
    engine = FakeEngine(kv_free=kv)
    shadows = Shadows(engine)
    plans = StepPlans(engine, shadows)
    plans.keep_template({"tokens": []})
    return engine, shadows, plans


def test_a_followers_slots_follow_the_leaders_frees_not_its_requests_ends():
    engine, shadows, plans = follower()
    aliases: dict[int, int] = {}
    plans.execute(Forward({"tokens": [("a", 4, 4)]}, ["a"], slots=[40, 41, 42, 43]), aliases)
    assert sorted(aliases) == [40, 41, 42, 43] and engine.kv_free == 96
    # "a" ended; the leader's tree keeps its first three slots and frees the fourth
    plans.execute(Forward({"tokens": [("b", 1, 1)]}, ["b"], slots=[44], freed=[43]), aliases)
    assert "a" not in shadows and sorted(aliases) == [40, 41, 42, 44] and engine.kv_free == 96
    # "c" starts from the cached prefix: its row reads this member's copies of the leader's slots
    plans.execute(
        Forward({"tokens": [("c", 5, 2)]}, ["b", "c"], slots=[45, 46], prefixes={"c": [40, 41, 42]}), aliases
    )
    assert shadows.slots("c").tolist() == [aliases[v] for v in (40, 41, 42, 45, 46)]
    assert f"write_row {shadows._by_rid['c'].row} 3@0" in engine.calls
    plans.follow_frees(Noop(freed=[40, 41]).freed, aliases)
    assert engine.kv_free == 96
    plans.free_aliases(aliases)
    shadows.free_all()
    assert engine.kv_free == 100 and not aliases


def test_an_adopted_shadow_frees_its_own_kv_and_the_leader_frees_what_plans_added():
    engine, shadows, plans = follower()
    aliases: dict[int, int] = {}
    adopted = engine.alloc_slots(5)
    assert adopted is not None
    shadows.add("a", engine.alloc_row(), adopted)
    plans.execute(Forward({"tokens": [("a", 6, 1)]}, ["a"], slots=[70]), aliases)
    plans.execute(Forward({"tokens": [("z", 1, 1)]}, ["z"], slots=[71]), aliases)  # "a" ended: its own 5 go
    assert engine.kv_free == 98 and sorted(aliases) == [70, 71]
    plans.follow_frees([70, 71], aliases)
    assert engine.kv_free == 100


def test_a_request_computed_again_from_its_start_drops_its_old_slots():
    engine, shadows, plans = follower()
    aliases: dict[int, int] = {}
    plans.execute(Forward({"tokens": [("a", 3, 3)]}, ["a"], slots=[1, 2, 3]), aliases)
    # retracted by the leader (its slots freed) and prefilled again from its start
    plans.execute(Forward({"tokens": [("a", 3, 3)]}, ["a"], slots=[4, 5, 6], freed=[1, 2, 3]), aliases)
    assert len(shadows.slots("a")) == 3 and sorted(aliases) == [4, 5, 6] and engine.kv_free == 97


def test_a_row_the_leaders_checkpoint_pointed_at_the_trees_slots_reads_this_members_copies_of_them():
    engine, shadows, plans = follower()
    aliases: dict[int, int] = {}
    plans.execute(Forward({"tokens": [("b", 4, 4)]}, ["b"], slots=[10, 11, 12, 13]), aliases)
    plans.execute(Forward({"tokens": [("a", 4, 4)]}, ["a"], slots=[40, 41, 42, 43]), aliases)
    tree = [aliases[v] for v in (10, 11, 12, 13)]
    # "a"'s prompt was in the tree already: the leader freed its duplicates and points its row at the tree's
    msg = Forward({"tokens": [("a", 5, 1)]}, ["a"], slots=[44], freed=[40, 41, 42, 43])
    msg.repoints = {"a": (0, [10, 11, 12, 13])}
    plans.execute(msg, aliases)
    assert shadows.slots("a").tolist() == [*tree, aliases[44]]
    assert f"write_row {shadows._by_rid['a'].row} 4@0" in engine.calls
    assert engine.kv_free == 100 - 4 - 1 and sorted(aliases) == [10, 11, 12, 13, 44]
