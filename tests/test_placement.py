"""Placement alone (router.placement): long, priority and light-load binds, group choice and fast targets."""

from __future__ import annotations

import msgspec

from flying.messages import Group, QueuedRequest
from router.decision import BindMode, BindNote
from router.engine_view import EngineView
from router.placement import (
    fast_targets,
    group_for,
    load_binds,
    need_width,
    owner,
    place,
    place_long,
    place_priority,
)
from router.round import SHORT, USABLE, Round
from router.snapshot import GroupLoad, Snapshot
from tests.policy_settings import (
    BUSY,
    LIGHT,
    LIGHT_NO_LOAD,
    UNIT_LIMITS,
    UNIT_POLICY,
    off,
    planned,
    unit_limits,
    unit_policy,
)

CFG = UNIT_POLICY


def eng(i, inflight=0, cap=1000, epoch=0, kvt=False, mixed=False):
    return EngineView(i, f"e{i}", inflight, cap, cap, mode="tp" if epoch else "dp", epoch=epoch, num_engines=4,
                      beat_ts=100.0, kv_transform=kvt, mixed_steps=mixed)  # fmt: skip


def req(i="r", prompt=10, priority="normal", at=100.0):
    return QueuedRequest(id=i, priority=priority, model="m", prompt_tokens=prompt, max_tokens=10, gateway="g", enqueued_at=at)  # fmt: skip


def rnd(engines=None, groups=(), state=BUSY, waiting=(), cfg=CFG, loads=None, limits=UNIT_LIMITS):
    engines = [eng(i) for i in range(4)] if engines is None else engines
    s = Snapshot(now=100.0, waiting=list(waiting), queued=len(waiting), engines=engines, groups=list(groups), state=state,
                 tp_load=loads or {}, limits=limits)  # fmt: skip
    r = Round(s, cfg)
    r.out.state = state
    return r


def test_need_width_picks_dp_the_narrowest_pool_or_none():
    es = [eng(i) for i in range(4)]
    assert [need_width(k, es) for k in (1000, 1001, 2001, 4001)] == [1, 2, 4, None]


def test_a_long_request_binds_the_least_loaded_block_it_needs_sequentially_by_default():
    """Not calm (demand above light) and its wait over (long_wait_s 0): the width its KV needs."""
    r = rnd(
        [eng(0, inflight=5), eng(1, inflight=5), eng(2), eng(3)],
        cfg=unit_policy(long_wait_s=0.0, preempt="sequential"),
    )
    place_long(r, req(prompt=1500), 2)
    assert [(g.members, g.reason, g.preempt) for g in r.out.binds] == [((2, 3), "long", "sequential")]
    assert r.out.events == [BindNote((2, 3), "long", BindMode.SEQUENTIAL, engines=4)] and r.reserved == {2, 3}


def test_a_high_priority_request_binds_a_block_and_leaves_dp_engines_for_the_rest():
    r = rnd([eng(0), eng(1)], state=LIGHT_NO_LOAD)
    assert not place_priority(r, req(priority="high")), "it would take the last DP engines"
    r = rnd(state=LIGHT_NO_LOAD)
    assert place_priority(r, req(priority="high"))
    assert [(g.members, g.reason, g.preempt) for g in r.out.binds] == [((0, 1), "priority", "hard")]


def test_light_load_binds_idle_blocks_hard_and_nothing_when_busy():
    r = rnd(state=LIGHT)
    load_binds(r)
    assert [(g.members, g.preempt) for g in r.out.binds] == [((0, 1), "hard"), ((2, 3), "hard")]
    r = rnd(state=BUSY)
    load_binds(r)
    assert not r.out.binds


def test_light_load_adopts_a_busy_block_whose_members_transform_kv():
    r = rnd([eng(0, inflight=2, kvt=True), eng(1, inflight=2, kvt=True), eng(2, inflight=1), eng(3, inflight=1)], state=LIGHT)  # fmt: skip
    load_binds(r)
    assert [(g.members, g.preempt, g.adopt) for g in r.out.binds] == [
        ((2, 3), "sequential", False),  # the least loaded first: it drains (one of two blocks)
        ((0, 1), "hard", True),
    ]
    assert r.out.events[1] == BindNote((0, 1), "load", BindMode.ADOPT, r.kv.adopt_ms((0, 1)), engines=4)


def test_light_load_binds_a_busy_block_keeping_its_dp_work_where_its_members_run_mixed_steps():
    """Members that run mixed steps keep their DP requests running beside the group: the block binds at once, a
    backlog and all (no adoption limit, no drain, no narrow block first); ``mixed_steps`` off: as before."""
    loads = (40, 40, 44, 44)  # above adopt_max_inflight and drain_inflight
    cfg, eight = unit_policy(max_width=4), unit_limits(adopt_max_inflight=8)
    r = rnd(
        [eng(i, inflight=n, kvt=True, mixed=True) for i, n in enumerate(loads)],
        state=planned(4),
        cfg=cfg,
        limits=eight,
    )
    load_binds(r)
    assert [(g.members, g.preempt, g.adopt, g.keep) for g in r.out.binds] == [
        ((0, 1, 2, 3), "hard", False, True)
    ]
    assert r.out.events[0] == BindNote((0, 1, 2, 3), "load", BindMode.KEEP, engines=4)
    assert "DP work kept running beside it" in str(r.out.events[0])
    assert BindMode.of(r.out.binds[0]) is BindMode.KEEP
    r = rnd(
        [eng(i, inflight=n, kvt=True, mixed=i != 3) for i, n in enumerate(loads)],
        state=planned(4),
        cfg=cfg,
        limits=eight,
    )
    load_binds(r)
    assert not r.out.binds, "engine 3 runs no mixed steps, and the block's backlog is too large to adopt"
    no_mixed = off("mixed-steps", base=cfg)
    r = rnd(
        [eng(i, inflight=n, kvt=True, mixed=True) for i, n in enumerate(loads)],
        state=planned(4),
        cfg=no_mixed,
        limits=eight,
    )
    load_binds(r)
    assert not any(g.keep for g in r.out.binds), "mixed_steps off: no keep"


def test_a_high_priority_request_binds_a_busy_block_keeping_its_dp_work():
    r = rnd([eng(i, inflight=3, mixed=True) for i in range(4)], state=LIGHT_NO_LOAD)
    assert place_priority(r, req(priority="high"))
    assert [(g.members, g.reason, g.keep) for g in r.out.binds] == [((0, 1), "priority", True)]


def test_group_for_prefers_the_narrowest_bound_group_with_room():
    bound = Group(epoch=4, members=(0, 1), reason="load", state="bound")
    forming = Group(epoch=5, members=(2, 3), reason="load", state="binding", preempt="sequential")
    r = rnd([eng(0, epoch=4), eng(1, epoch=4), eng(2), eng(3)], [forming, bound])
    assert group_for(r, req(), 1, USABLE, SHORT, imminent=True) == bound
    r = rnd([eng(0), eng(1), eng(2), eng(3)], [forming])
    assert group_for(r, req(), 1, USABLE, SHORT, imminent=True) is None, "a draining bind is not imminent"


def test_light_load_sends_a_normal_request_to_the_load_group_and_fast_targets_follow():
    g = Group(epoch=4, members=(0, 1), reason="load", state="bound")
    r = rnd([eng(0, epoch=4), eng(1, epoch=4), eng(2), eng(3)], [g], state=LIGHT)
    place(r, req())
    assert [(x.engine, x.epoch) for x in r.out.dispatches] == [(0, 4)]
    [target] = fast_targets(r)
    assert (target.engine, target.epoch, target.cap) == (0, 4, 1 + 2 * UNIT_LIMITS.tp_inflight_per_engine - 1)


def test_busy_fast_targets_are_the_dp_engines_in_no_group():
    g = Group(epoch=4, members=(0, 1), reason="priority", state="bound")
    r = rnd([eng(0, epoch=4), eng(1, epoch=4), eng(2), eng(3)], [g])
    assert [t.engine for t in fast_targets(r)] == [2, 3]


def spread_group(inflight=(0, 0), kvt=True, cfg=CFG):
    """A bound load group (0, 1) under light load, its members holding ``inflight`` requests."""
    g = Group(epoch=4, members=(0, 1), reason="load", state="bound")
    es = [eng(m, inflight=n, epoch=4, kvt=kvt) for m, n in enumerate(inflight)] + [eng(2), eng(3)]
    return g, rnd(es, [g], state=LIGHT, cfg=cfg)


def test_a_groups_tp_requests_go_to_its_members_in_turn_each_to_its_own_url():
    g, r = spread_group()
    for i in range(4):
        place(r, req(f"r{i}"))
    assert [(x.engine, x.url, x.epoch) for x in r.out.dispatches] == [
        (0, "e0", 4), (1, "e1", 4), (0, "e0", 4), (1, "e1", 4)
    ]  # fmt: skip
    assert r.tp[4][0] == 4, "the group counts every member's requests"


def test_the_member_holding_fewer_requests_owns_the_next_one():
    """Paused DP work and the TP requests a member owns already count: after a release each engine holds as many
    requests as can be."""
    g, r = spread_group(inflight=(3, 1))
    assert owner(r, g).engine == 1
    for i in range(3):
        place(r, req(f"r{i}"))
    assert [x.engine for x in r.out.dispatches] == [1, 1, 0]  # 3 + 0 and 1 + 2 tie: the leader first


def test_the_leader_owns_every_tp_request_where_members_cannot_scatter_or_spreading_is_off():
    """A release by retraction recomputes the group's requests on its leader: without KV transformation they stay
    the leader's; ``spread_ownership`` off, too."""
    for _, r in (spread_group(kvt=False), spread_group(cfg=off("spread-ownership"))):
        for i in range(3):
            place(r, req(f"r{i}"))
        assert [x.engine for x in r.out.dispatches] == [0, 0, 0]
        [target] = fast_targets(r)
        assert target.engine == 0


def test_a_constrained_request_goes_to_the_leader_and_a_followers_target_says_it_is_one():
    """A follower cannot hand a grammar to its leader: a leader-only request is the leader's, and the fast path
    knows which targets are followers."""
    g, r = spread_group(inflight=(3, 0))
    place(r, msgspec.structs.replace(req("j"), leader_only=True))
    place(r, req("plain"))
    assert [(x.request.id, x.engine) for x in r.out.dispatches] == [("j", 0), ("plain", 1)]
    assert [(t.engine, t.follower) for t in fast_targets(r)] == [(0, False), (1, True)]


def test_fast_targets_of_a_spread_group_are_its_members_sharing_its_room():
    """One target per member (the admission script picks the least loaded); their caps add up to the group's room,
    above what each holds now."""
    g, r = spread_group(inflight=(2, 0))
    place(r, req())  # -> engine 1
    room = 2 * UNIT_LIMITS.tp_inflight_per_engine - 1
    targets = fast_targets(r)
    assert [(t.engine, t.url, t.epoch) for t in targets] == [(0, "e0", 4), (1, "e1", 4)]
    assert [t.cap for t in targets] == [2 + (room + 1) // 2, 1 + room // 2]


def test_no_narrower_load_group_binds_beside_a_group_being_released():
    """A group released so that its block binds whole (widening): the rest of the block waits for that release
    instead of binding narrower groups that the next round would widen again."""
    g = Group(epoch=4, members=(0, 1), reason="priority", state="releasing")
    r = rnd([eng(0, epoch=4), eng(1, epoch=4), eng(2), eng(3)], [g], state=LIGHT, cfg=unit_policy())
    load_binds(r)
    assert not r.out.binds
    r = rnd([eng(0, epoch=4), eng(1, epoch=4), eng(2), eng(3)], [], state=LIGHT, cfg=unit_policy())
    load_binds(r)
    assert [g.members for g in r.out.binds] == [(2, 3)], "(0, 1) no longer in a record: the rest binds"


def test_where_groups_park_a_normal_long_request_binds_at_least_long_min_width_at_most_half_the_node(
    monkeypatch,
):
    def eight(park=True):
        return [
            EngineView(i, f"e{i}", 0, 1000, 1000, num_engines=8, beat_ts=100.0, park=park) for i in range(8)
        ]

    monkeypatch.setattr("router.placement.LONG_MIN_WIDTH", 8)
    cfg = unit_policy(long_wait_s=0.0)
    r = rnd(eight(), state=LIGHT, cfg=cfg)
    place_long(r, req(prompt=1500), 2)
    assert [g.members for g in r.out.binds] == [(0, 1, 2, 3)]  # wider than it needs, half the node at most
    r = rnd(eight(), state=LIGHT, cfg=cfg)
    place_long(r, req(prompt=1500, priority="high"), 2)
    assert [(g.members, g.hold) for g in r.out.binds] == [((0, 1), True)]  # at once, as narrow as it can
    for engines, c in ((eight(park=False), cfg), (eight(), off("park", base=cfg))):
        r = rnd(engines, state=LIGHT, cfg=c)
        place_long(r, req(prompt=1500), 2)
        assert [g.members for g in r.out.binds] == [(0, 1)]  # never parked: the width its KV needs


def test_a_group_held_for_a_high_priority_long_request_holds_no_longer_once_it_is_idle(monkeypatch):
    monkeypatch.setattr("router.placement.LONG_MIN_WIDTH", 2)
    engines = [EngineView(i, f"e{i}", 0, 1000, 1000, mode="tp" if i < 2 else "dp", epoch=5 if i < 2 else 0,
                          num_engines=8, beat_ts=100.0, park=True) for i in range(8)]  # fmt: skip
    held = Group(epoch=5, members=(0, 1), reason="long", state="bound", hold=True)
    r = rnd(engines, [held], state=LIGHT, cfg=unit_policy(long_wait_s=10.0))
    place_long(r, req(prompt=1500), 2)  # its high-priority request ended: a normal one may be parked
    assert [x.epoch for x in r.out.dispatches] == [5] and not r.out.put[5].hold
    r = rnd(engines, [held], state=LIGHT, cfg=unit_policy(long_wait_s=0.0),
            loads={5: GroupLoad(1, 300, 300)})  # fmt: skip
    place_long(r, req(prompt=1500), 2)  # still serving a request: the group stays held
    assert [x.epoch for x in r.out.dispatches] == [5] and r.out.put[5].hold


def test_a_long_request_that_waited_twice_long_wait_s_keeps_its_group_held_when_dispatched(monkeypatch):
    monkeypatch.setattr("router.placement.LONG_MIN_WIDTH", 2)
    engines = [EngineView(i, f"e{i}", 0, 1000, 1000, mode="tp" if i < 2 else "dp", epoch=5 if i < 2 else 0,
                          num_engines=8, beat_ts=100.0, park=True) for i in range(8)]  # fmt: skip
    held = Group(
        epoch=5, members=(0, 1), reason="long", state="bound", hold=True
    )  # bound for it, nothing sent yet
    r = rnd(engines, [held], state=LIGHT, cfg=unit_policy(long_wait_s=10.0))
    place_long(r, req(prompt=1500, at=70.0), 2)  # waited 30 s: never parked
    assert [x.epoch for x in r.out.dispatches] == [5] and r.out.put[5].hold


def test_a_long_request_still_goes_to_a_bound_group_narrower_than_long_min_width(monkeypatch):
    monkeypatch.setattr("router.placement.LONG_MIN_WIDTH", 4)
    engines = [EngineView(i, f"e{i}", 0, 1000, 1000, mode="tp" if i < 2 else "dp", epoch=5 if i < 2 else 0,
                          num_engines=8, beat_ts=100.0, park=True) for i in range(8)]  # fmt: skip
    manual = Group(epoch=5, members=(0, 1), reason="manual", state="bound")
    r = rnd(engines, [manual], state=LIGHT, cfg=unit_policy(long_wait_s=0.0))
    place_long(r, req(prompt=1500), 2)
    assert not r.out.binds and [(x.epoch, x.engine) for x in r.out.dispatches] == [(5, 0)]
