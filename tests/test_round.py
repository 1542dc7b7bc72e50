"""A round's shared bookkeeping (router.round): free blocks, binds and the room a group has."""

from __future__ import annotations

import dataclasses

import msgspec

from flying.messages import Group, QueuedRequest, RouterState
from router.decision import BindMode, BindNote
from router.engine_view import EngineView
from router.round import Round, decayed_recent
from router.snapshot import GroupLoad, Snapshot
from tests.policy_settings import UNIT_LIMITS, UNIT_POLICY


def eng(i, inflight=0, free=1000, cap=1000, **kw):
    return EngineView(i, f"e{i}", inflight, free, cap, num_engines=4, beat_ts=100.0, **kw)


def rnd(engines, groups=(), loads=None, suspect=None):
    state = RouterState(suspect=suspect or {})
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[], queued=0, engines=engines, groups=list(groups), tp_load=loads or {}, state=state)  # fmt: skip
    return Round(s, UNIT_POLICY)


def test_free_blocks_are_live_idle_dp_engines_in_no_group_least_loaded_first():
    r = rnd([eng(0, inflight=2), eng(1), eng(2), eng(3)])
    assert r.free_sets(2) == [(2, 3), (0, 1)] and r.free_sets(4) == [(0, 1, 2, 3)] and r.free_sets(8) == []
    assert rnd([eng(0), eng(1), eng(2, pending=4), eng(3)]).free_sets(2) == [(0, 1)]
    assert rnd([eng(0), eng(1), eng(2), eng(3)], suspect={3: 110.0}).free_sets(2) == [(0, 1)]
    assert rnd([eng(0), eng(1), eng(2), eng(3)], suspect={3: 90.0}).free_sets(2) == [(0, 1), (2, 3)], (
        "expired"
    )
    g = Group(epoch=5, members=(0, 1), reason="load")
    assert rnd([eng(i) for i in range(4)], [g]).free_sets(2) == [(2, 3)]
    connecting = rnd([eng(0, pool_ready=False), eng(1), eng(2), eng(3)])  # a restarted engine's pool connects
    assert connecting.free_sets(2) == [(2, 3)] and connecting.free_sets(4) == []


def test_a_bind_reserves_its_members_and_caps_a_hard_groups_kv_at_nine_tenths_of_their_free_kv():
    r = rnd([eng(0, free=600), eng(1, free=400), eng(2), eng(3)])
    g = r.bind((0, 1), "priority", "hard")
    assert (g.epoch, g.kv_cap, g.since) == (0, 900, 100.0) and r.reserved == {0, 1}
    assert r.free_sets(2) == [(2, 3)] and r.out.events == [
        BindNote((0, 1), "priority", BindMode.HARD, engines=4)
    ]
    assert r.bind((2, 3), "long", "sequential").kv_cap == 0, "a sequential bind waits for the members' KV"


def test_a_groups_room_counts_its_tp_requests_and_kv():
    g = Group(epoch=5, members=(0, 1), reason="priority", state="bound", kv_cap=500)
    paused = rnd([eng(0, inflight=1), eng(1)], [g])  # one DP request paused on engine 0: KV capped
    req = QueuedRequest(id="r", priority="high", model="m", prompt_tokens=300, max_tokens=300, gateway="g", enqueued_at=0.0)  # fmt: skip
    assert not paused.group_room(g, req) and paused.paused_dp(g) == 1
    free = rnd([eng(0, inflight=2), eng(1)], [g], loads={5: GroupLoad(2, 100, 50)})  # both are the group's
    assert free.group_room(g, req) and free.group_n(g) == 2 and free.paused_dp(g) == 0


def test_recent_dispatches_decay_and_forget_engines_that_left():
    st = RouterState(recent={0: 4.0, 1: 0.001, 7: 2.0}, rate_ts=99.0)
    live = {0: eng(0), 1: eng(1)}
    assert decayed_recent(st, 100.0, 1.0, live) == {0: 4.0 * 0.36787944117144233}
    assert decayed_recent(st, 100.0, 0.0, live) == {}


def test_a_load_group_of_short_requests_takes_sp_inflight_per_engine_and_one_running_a_long_request_less():
    cfg, lim = (
        UNIT_POLICY,
        dataclasses.replace(UNIT_LIMITS, tp_inflight_per_engine=2, sp_inflight_per_engine=8),
    )
    g = Group(epoch=5, members=(0, 1), reason="load", state="bound")
    req = QueuedRequest(id="r", model="m", prompt_tokens=10, max_tokens=10, gateway="g", enqueued_at=0.0)

    def room(n: int, max_kv: int, reason: str = "load") -> bool:
        x = msgspec.structs.replace(g, reason=reason)
        s = Snapshot(limits=lim, now=100.0, waiting=[], queued=0, engines=[eng(0, epoch=5, mode="tp"), eng(1, epoch=5, mode="tp")],
                     groups=[x], tp_load={5: GroupLoad(n, 100, max_kv)}, state=RouterState(busy=False))  # fmt: skip
        return Round(s, cfg).group_room(x, req)

    assert room(15, 100) and not room(16, 100)  # width 2 x 8: its SP steps keep up
    assert room(3, 1500) and not room(4, 1500)  # a request one engine cannot hold: width 2 x 2
    assert not room(4, 100, reason="long") and not room(4, 100, reason="manual")
