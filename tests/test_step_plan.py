"""A follower's shadows of the group's TP requests and the plans it executes (worker_ext.step_plan)."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import FakeEngine
from worker_ext.rank_messages import Forward
from worker_ext.step_plan import FollowerOutOfKV, Shadows, StepPlans


def test_a_shadow_grows_step_by_step_and_frees_only_its_own_slots():
    engine = FakeEngine(kv_free=100)
    sh = Shadows(engine)
    sh.add("adopted", engine.alloc_row(), torch.arange(10), pinned=4)  # 4 tokens read in place from the tree
    row, slots = sh.extend("adopted", 11, 1)
    assert slots.numel() == 1 and sh.slots("adopted").numel() == 11
    sh.free("adopted")
    assert engine.slots_freed == 7 and engine.rows_in_use == set() and "adopted" not in sh


def test_executing_a_plan_frees_shadows_no_longer_live_and_runs_one_forward():
    engine = FakeEngine(kv_free=100)
    sh = Shadows(engine)
    plans = StepPlans(engine, sh)
    plans.keep_template({"tokens": []})
    plans.execute(Forward({"tokens": [("a", 3, 3), ("b", 2, 2)]}, ["a", "b"]))
    plans.execute(Forward({"tokens": [("a", 4, 1)]}, ["a"]))
    assert len(sh) == 1 and "a" in sh
    assert [len(slots) for _, slots in engine.forwards] == [5, 1]


def test_a_follower_out_of_slots_raises_an_error_the_binding_handles():
    engine = FakeEngine(kv_free=2)
    plans = StepPlans(engine, Shadows(engine))
    plans.keep_template({})
    with pytest.raises(FollowerOutOfKV):
        plans.execute(Forward({"tokens": [("a", 3, 3)]}, ["a"]))


def test_a_plan_before_any_own_batch_is_an_error():
    engine = FakeEngine()
    with pytest.raises(RuntimeError, match="no ForwardBatch"):
        StepPlans(engine, Shadows(engine)).execute(Forward({"tokens": []}, []))


def test_keepalives_are_due_only_after_a_quiet_interval():
    plans = StepPlans(FakeEngine(), Shadows(FakeEngine()))
    assert plans.keepalive_due()
    plans.sent()
    assert not plans.keepalive_due()
