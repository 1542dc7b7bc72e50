"""Client aborts relayed from a follower to its group's leader over the pool's store (worker_ext.aborts)."""

from __future__ import annotations

from tests.fakes import FakeEngine, FakePool, FakeReq, FakeStore
from worker_ext.aborts import AbortRelay
from worker_ext.ownership import Ownership


def test_a_followers_client_abort_reaches_the_leaders_copy():
    store = FakeStore()
    follower_engine = FakeEngine(aborts_in=[["r1"]])
    follower_own = Ownership(follower_engine)
    mine = FakeReq("r1")
    follower_own.hold([mine])
    AbortRelay(follower_engine, 1, FakePool({}, store=store)).forward(7, follower_own)
    assert mine.finished_reason == "abort" and follower_engine.streamed == ["r1"]

    leader_engine = FakeEngine()
    leader_own = Ownership(leader_engine)
    leader_own.add_copy(FakeReq("r1"), owner=1)
    relay = AbortRelay(leader_engine, 0, FakePool({}, store=store))
    relay.apply(7, leader_own)
    relay.apply(7, leader_own)  # polled again (after POLL_S): applied once
    assert leader_engine.calls == ["abort r1"]


def test_aborts_of_requests_the_follower_does_not_own_are_not_posted():
    store = FakeStore()
    engine = FakeEngine(aborts_in=[["other"]])
    AbortRelay(engine, 1, FakePool({}, store=store)).forward(7, Ownership(engine))
    assert store.counters == {}


def test_a_leader_without_copies_does_not_poll_the_store():
    engine = FakeEngine()
    AbortRelay(engine, 0, FakePool({}, store=None)).apply(
        1, Ownership(engine)
    )  # no store, no copies: no error
    assert engine.calls == []
