"""The pending bind and the DP work held back for it (worker_ext.preemption): hard, sequential and soft."""

from __future__ import annotations

import pytest

from flying.messages import Bind
from tests.fakes import FakeEngine, FakePool, FakeReq, FakeStore
from worker_ext.preemption import PendingBind


def pending(index: int, engine: FakeEngine, store: FakeStore | None) -> PendingBind:
    return PendingBind(engine, index, FakePool({}, store=store))


def test_a_hard_bind_is_ready_at_the_next_clean_step_boundary():
    engine = FakeEngine(clean=False)
    p = pending(0, engine, FakeStore())
    p.accept(Bind(epoch=4, members=(0, 1)))
    assert p.take_ready() is None and p.epoch == 4
    engine.clean = True
    assert p.take_ready() == Bind(epoch=4, members=(0, 1)) and p.epoch == 0


def test_soft_the_leader_keeps_serving_new_work_and_binds_after_members_drain():
    store = FakeStore()
    cmd = Bind(epoch=5, members=(0, 1), preempt="soft")
    leader_engine = FakeEngine(running_reqs=[FakeReq("old")], waiting_reqs=[FakeReq("queued")])
    member_engine = FakeEngine(waiting_reqs=[FakeReq("m")])
    leader, member = pending(0, leader_engine, store), pending(1, member_engine, store)
    leader.accept(cmd)
    member.accept(cmd)
    assert leader.take_ready() is None  # its DP work present at the command must drain first
    assert leader.held == 1 and leader_engine.waiting_reqs == []
    leader_engine.waiting_reqs = [
        FakeReq("tp-new")
    ]  # arrives after the command: the group's, started at once
    assert member.take_ready() is None and member.held == 1  # counted itself drained, waits for the go
    leader_engine.running_reqs[0].finished_reason = "stop"
    assert leader.take_ready() == cmd  # every member drained: sets the go
    assert [r.rid for r in leader_engine.waiting_reqs] == ["tp-new"]
    assert member.take_ready() == cmd


def test_a_sequential_bind_without_a_pool_is_ready_once_this_engine_drained():
    engine = FakeEngine(running_reqs=[FakeReq("r")], waiting_reqs=[FakeReq("w")])
    p = pending(0, engine, None)
    p.accept(Bind(epoch=1, members=(0, 1), preempt="sequential"))
    assert p.take_ready() is None and p.held == 1
    engine.running_reqs[0].finished_reason = "stop"
    assert p.take_ready() is not None and [r.rid for r in p.take_held()] == ["w"]


def test_an_unreachable_store_keeps_the_bind_pending():
    class Down(FakeStore):
        def add(self, key: str, n: int) -> int:
            raise RuntimeError("connection refused")

    p = pending(0, FakeEngine(), Down())
    p.accept(Bind(epoch=1, members=(0, 1), preempt="sequential"))
    assert p.take_ready() is None and p.epoch == 1


def test_cancel_returns_the_epoch_and_lets_held_work_in_at_the_front():
    engine = FakeEngine(waiting_reqs=[FakeReq("a")])
    p = pending(0, engine, FakeStore())
    p.accept(Bind(epoch=2, members=(0, 1), preempt="sequential"))
    p.take_ready()
    engine.waiting_reqs = [FakeReq("b")]
    assert p.cancel() == 2 and [r.rid for r in engine.waiting_reqs] == ["a", "b"] and p.epoch == 0
    with pytest.raises(RuntimeError):
        p.cancel()
