"""Who streams each TP request (worker_ext.ownership): the leader's copies and outbox, a follower's own requests."""

from __future__ import annotations

from tests.fakes import FakeEngine, FakeReq
from worker_ext.ownership import Ownership
from worker_ext.sglang_patches.requests import Emitted


def test_a_copys_new_output_goes_to_the_outbox_once_and_the_copy_is_forgotten_when_it_finishes():
    engine = FakeEngine()
    o = Ownership(engine)
    copy, own = FakeReq("r1", output_ids=[5]), FakeReq("r2")
    o.add_copy(copy, owner=1)
    assert o.has_copies and o.owner_of("r1") == 1 and o.owner_of("r2") == 0
    assert not o.divert(own)  # the leader's own request streams here
    copy.output_ids += [6, 7]
    assert o.divert(copy) and [e.output_ids for e in o.take_outbox()] == [[6, 7]]
    assert o.divert(copy) and o.take_outbox() == []  # nothing new, nothing sent
    copy.output_ids.append(8)
    copy.finished_reason = "stop"
    o.divert(copy)
    (em,) = o.take_outbox()
    assert em.output_ids == [8] and em.finished_reason == "stop" and not o.has_copies


def test_a_follower_streams_what_the_leader_emitted_for_its_own_requests_only():
    engine = FakeEngine()
    o = Ownership(engine)
    mine = FakeReq("r1", output_ids=[1])
    o.hold([mine])
    o.deliver([Emitted(rid="r1", output_ids=[2]), Emitted(rid="someone-else", output_ids=[9])])
    assert mine.output_ids == [1, 2] and engine.streamed == ["r1"]
    o.deliver([Emitted(rid="r1", output_ids=[3], finished_reason="stop")])
    assert o.owned() == {} and "let_go r1" in engine.calls


def test_a_client_abort_ends_the_followers_own_request_by_id_prefix():
    engine = FakeEngine()
    o = Ownership(engine)
    a, b = FakeReq("req-a_1"), FakeReq("req-b")
    o.hold([a, b])
    assert o.end_aborted(["req-a"]) == ["req-a_1"]
    assert a.finished_reason == "abort" and list(o.owned()) == ["req-b"]
    assert o.end_aborted(["nobody"]) == []


def test_forgetting_copies_empties_the_outbox():
    o = Ownership(FakeEngine())
    copy = FakeReq("r1")
    o.add_copy(copy, owner=1)
    copy.output_ids.append(1)
    o.divert(copy)
    o.forget_copies()
    assert not o.has_copies and not o.has_outbox


def test_a_copy_the_leader_aborts_outside_its_output_stream_ends_on_its_owner():
    """SGLang aborts the last request a full pool cannot decode through ``send_abort_output``, not the output
    stream: for a copy, the end goes to its owner (whose client would otherwise wait forever)."""
    engine = FakeEngine()
    leader, follower = Ownership(engine), Ownership(FakeEngine())
    copy, own = FakeReq("r1", output_ids=[5]), FakeReq("r2")
    leader.add_copy(copy, owner=1)
    assert not leader.end(own), "the leader's own request: SGLang tells its client itself"
    copy.to_finish = "abort: out of memory"
    assert leader.end(copy) and not leader.has_copies
    mine = FakeReq("r1", output_ids=[5])
    follower.hold([mine])
    follower.deliver(leader.take_outbox())
    assert mine.finished_reason == "abort: out of memory" and follower.owned() == {}
