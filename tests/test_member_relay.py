"""What reaches a follower's endpoint while it follows, relayed to its group's leader over the pool's store
(worker_ext.member_relay): client aborts and new requests."""

from __future__ import annotations

from tests.fakes import FakeEngine, FakePool, FakeReq, FakeStore
from worker_ext.epoch import Epoch
from worker_ext.member_relay import MemberRelay
from worker_ext.ownership import Ownership


def epoch(rank: int) -> Epoch:
    return Epoch(7, (0, 1), rank, group=None)  # type: ignore[arg-type]


def leader(store: FakeStore) -> tuple[FakeEngine, Ownership, MemberRelay]:
    engine = FakeEngine()
    return engine, Ownership(engine), MemberRelay(engine, 0, FakePool({}, store=store))


def test_a_followers_client_abort_reaches_the_leaders_copy():
    store = FakeStore()
    f_engine = FakeEngine(aborts_in=[["r1"]])
    f_own = Ownership(f_engine)
    mine = FakeReq("r1")
    f_own.hold([mine])
    MemberRelay(f_engine, 1, FakePool({}, store=store)).forward(epoch(1), f_own)
    assert mine.finished_reason == "abort" and f_engine.streamed == ["r1"]

    l_engine, l_own, relay = leader(store)
    l_own.add_copy(FakeReq("r1"), owner=1)
    relay.apply(epoch(0), l_own)
    relay._polled = 0.0
    relay.apply(epoch(0), l_own)  # read again: applied once
    assert l_engine.calls == ["abort r1"]


def test_a_new_request_at_a_follower_runs_on_the_leader_as_a_copy_the_follower_streams():
    store = FakeStore()
    new = FakeReq("n1")
    f_engine = FakeEngine(new_in=[[new]])
    f_own = Ownership(f_engine)
    MemberRelay(f_engine, 1, FakePool({}, store=store)).forward(epoch(1), f_own)
    assert list(f_own.owned()) == ["n1"]  # it streams from here

    l_engine, l_own, relay = leader(store)
    relay.apply(epoch(0), l_own)
    (copy,) = l_engine.waiting_reqs
    assert copy.rid == "n1" and l_own.owner_of("n1") == 1
    copy.output_ids.append(5)
    assert l_own.divert(copy)
    (em,) = l_own.take_outbox()
    f_own.deliver([em])
    assert new.output_ids == [5] and f_engine.streamed == ["n1"]


def test_a_request_the_leader_never_took_stays_the_followers_to_run_in_dp():
    engine = FakeEngine(new_in=[[FakeReq("late")]])
    own = Ownership(engine)
    MemberRelay(engine, 1, FakePool({}, store=None)).forward(epoch(1), own)  # no store: nothing posted
    assert [r.rid for r in own.take_unstarted()] == ["late"] and own.owned() == {}


def test_aborts_of_requests_the_follower_does_not_own_are_not_posted():
    store = FakeStore()
    engine = FakeEngine(aborts_in=[["other"]])
    MemberRelay(engine, 1, FakePool({}, store=store)).forward(epoch(1), Ownership(engine))
    assert store.counters == {}
