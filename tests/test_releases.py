"""Releases alone (router.releases): records follow the heartbeats, and each release carries its typed cause."""

from __future__ import annotations

import dataclasses

from flying.messages import Group, QueuedRequest, Release
from router.decision import DistrustNote, ReleaseCause, ReleaseMode
from router.engine_view import EngineView
from router.releases import KEEP_S, reconcile, release_groups, release_idle_blocking, release_now
from router.round import Round
from router.snapshot import GroupLoad, Snapshot
from tests.policy_settings import BUSY, LIGHT, UNIT_LIMITS, UNIT_POLICY, planned

CFG = UNIT_POLICY


def eng(i, epoch=0, pending=0, inflight=0, cap=1000, ts=100.0, kvt=False, paused=0):
    mode = "tp" if epoch else "dp"
    return EngineView(i, f"e{i}", inflight, cap, cap, mode=mode, epoch=epoch, pending=pending, num_engines=4,
                      beat_ts=ts, kv_transform=kvt, paused=paused)  # fmt: skip


def group(epoch=5, members=(0, 1), reason="priority", state="bound", since=99.0, **kw):
    return Group(epoch=epoch, members=members, reason=reason, state=state, since=since, last_used=since, **kw)


def rnd(groups, engines, state=BUSY, waiting=(), loads=None, cfg=CFG, now=100.0):
    s = Snapshot(now=now, waiting=list(waiting), queued=len(waiting), engines=engines, groups=groups,
                 tp_load=loads or {}, state=state, limits=UNIT_LIMITS)  # fmt: skip
    return Round(s, cfg)


def causes(r):
    return [(n.epoch, n.cause, n.mode) for n in r.out.releases]


def test_a_binding_group_is_bound_once_every_member_reports_its_epoch():
    r = rnd([group(state="binding")], [eng(0, epoch=5), eng(1, epoch=5)])
    reconcile(r)
    assert r.out.put[5].state == "bound" and r.out.put[5].since == 100.0 and not r.out.commands


def test_a_silent_member_rolls_the_bind_back_and_is_distrusted():
    r = rnd([group(state="binding", since=97.0)], [eng(0, pending=5), eng(1)])
    reconcile(r)
    assert causes(r) == [(5, ReleaseCause.NOT_ACKNOWLEDGED, ReleaseMode.WAIT)]
    assert r.out.releases[0].engines == (1,) and r.suspect == {1: 100.0 + UNIT_LIMITS.suspect_s}
    assert DistrustNote((1,), UNIT_LIMITS.suspect_s) in r.out.events


def test_a_width_change_is_acknowledged_by_the_leader_of_the_members_current_group():
    """The follower of a group reads no commands while bound: its leader's pending width change is its ack; the
    change waits for the group's TP requests up to bind_timeout_s."""
    old = [
        dataclasses.replace(eng(0, epoch=4, pending=5), group=(0, 1)),
        dataclasses.replace(eng(1, epoch=4), group=(0, 1)),
    ]
    r = rnd([group(state="binding", since=97.0)], old)
    reconcile(r)
    assert not causes(r)
    r = rnd([group(state="binding", since=97.0 - UNIT_LIMITS.bind_timeout_s)], old)
    reconcile(r)
    assert causes(r) == [(5, ReleaseCause.NOT_BOUND, ReleaseMode.WAIT)]
    quiet = [
        dataclasses.replace(eng(0, epoch=4), group=(0, 1)),
        dataclasses.replace(eng(1, epoch=4), group=(0, 1)),
    ]
    r = rnd([group(state="binding", since=97.0)], quiet)
    reconcile(r)  # the leader never read it: rolled back, and the epoch the members are in ends too
    assert causes(r) == [
        (5, ReleaseCause.NOT_ACKNOWLEDGED, ReleaseMode.WAIT),
        (4, ReleaseCause.UNKNOWN_EPOCH, ReleaseMode.RETRACT),
    ]


def test_a_lost_member_or_an_aborted_epoch_releases_the_group():
    r = rnd([group()], [eng(0, epoch=5)])
    reconcile(r)
    assert causes(r) == [(5, ReleaseCause.MEMBER_GONE, ReleaseMode.WAIT)]
    r = rnd([group()], [eng(0, epoch=5), eng(1)])
    reconcile(r)
    assert causes(r) == [(5, ReleaseCause.BROKE_UP, ReleaseMode.WAIT)]


def test_engines_bound_in_an_epoch_no_record_knows_are_released_from_it_and_the_record_follows():
    """A bind that reached its members after its record was rolled back (a width change that waited for its TP
    requests) left them in a group nobody dispatched to: every request then timed out in the queue."""
    bound = [dataclasses.replace(eng(i, epoch=4, kvt=True), group=(1, 0)) for i in (0, 1)]
    r = rnd([], [*bound, eng(2)])
    reconcile(r)
    assert causes(r) == [(4, ReleaseCause.UNKNOWN_EPOCH, ReleaseMode.SCATTER)]
    assert r.out.releases[0].members == (1, 0)  # the leader first, as the group was bound
    assert r.out.put[4].state == "releasing" and r.out.put[4].reason == "manual"
    known = rnd([group(epoch=4, members=(1, 0))], bound)
    reconcile(known)
    assert not known.out.releases  # a record knows it
    parked = rnd([group(epoch=4, members=(1, 0), state="parked")], bound)
    reconcile(parked)
    assert not [n for n in parked.out.releases if n.cause is ReleaseCause.UNKNOWN_EPOCH]
    # `flyctl bind` over the group: the old record replaced by the new one before the leader has read it
    changing = rnd(
        [group(epoch=5, members=(1, 0, 2, 3), state="binding", since=100.0)], [*bound, eng(2), eng(3)]
    )
    reconcile(changing)
    assert not [n for n in changing.out.releases if n.cause is ReleaseCause.UNKNOWN_EPOCH]
    # its leader gone (an open breaker hides it): the whole group is addressed, a plain release
    alone = rnd([], [bound[1], eng(2)])
    reconcile(alone)
    assert causes(alone) == [(4, ReleaseCause.UNKNOWN_EPOCH, ReleaseMode.WAIT)]
    assert alone.out.releases[0].members == (1, 0)


def test_a_releasing_record_is_dropped_once_fresh_beats_show_its_members_out_of_it():
    g = group(state="releasing", since=99.5)
    r = rnd([g], [eng(0, ts=99.6), eng(1, ts=99.6)])
    reconcile(r)
    assert r.out.drop == [5] and 5 not in r.groups
    r = rnd([g], [eng(0, ts=99.6), eng(1, ts=99.0)])
    reconcile(r)
    assert r.out.drop == [], "engine 1's heartbeat is older than the release"


def test_release_now_scatters_where_members_transform_else_retracts_unless_a_request_needs_the_pool():
    members = [eng(0, epoch=5, kvt=True), eng(1, epoch=5, kvt=True)]
    r = rnd([group()], members)
    release_now(r, r.groups[5], ReleaseCause.LOAD_ROSE)
    assert r.out.commands == [((0, 1), Release(epoch=5, scatter=True))]
    r = rnd([group()], [eng(0, epoch=5), eng(1, epoch=5)])
    release_now(r, r.groups[5], ReleaseCause.LOAD_ROSE)
    assert r.out.commands == [((0, 1), Release(epoch=5, retract=True))]
    r = rnd([group(adopt=True)], [eng(0, epoch=5), eng(1, epoch=5)])
    release_now(r, r.groups[5], ReleaseCause.LOAD_ROSE)
    assert r.out.commands == [((0, 1), Release(epoch=5))], "its adopted requests' streams are on their owners"
    r = rnd([group()], members, loads={5: GroupLoad(1, 1500, 1500)})
    release_now(r, r.groups[5], ReleaseCause.LOAD_ROSE)
    assert r.out.commands == [((0, 1), Release(epoch=5))], "a request one engine cannot hold"


def test_load_groups_go_when_load_is_busy_and_idle_ones_after_keep_s():
    r = rnd([group(reason="load")], [eng(0, epoch=5), eng(1, epoch=5)])
    release_groups(r)
    assert causes(r) == [(5, ReleaseCause.LOAD_ROSE, ReleaseMode.RETRACT)]
    r = rnd([group(since=98.0)], [eng(0, epoch=5), eng(1, epoch=5)])
    release_groups(r)
    assert (
        causes(r) == [(5, ReleaseCause.NO_TP_WORK, ReleaseMode.WAIT)] and r.out.releases[0].seconds == KEEP_S
    )
    high = QueuedRequest(id="h", priority="high", model="m", prompt_tokens=1, max_tokens=1, gateway="g", enqueued_at=99.0)  # fmt: skip
    r = rnd([group(since=98.0)], [eng(0, epoch=5), eng(1, epoch=5)], waiting=[high])
    release_groups(r)
    assert not r.out.commands, "a high-priority request waits: the idle group is kept for it"


def test_an_idle_group_of_the_planned_width_becomes_a_load_group():
    r = rnd([group(since=98.0)], [eng(0, epoch=5), eng(1, epoch=5)], state=LIGHT)
    release_groups(r)
    assert r.out.put[5].reason == "load" and not r.out.commands


def test_deferred_dp_work_releases_the_group_after_max_defer_s():
    members = [eng(0, epoch=5, inflight=2), eng(1, epoch=5)]  # two DP requests paused under the group
    r = rnd([group(since=100.0 - UNIT_LIMITS.max_defer_s)], members)
    release_groups(r)
    assert causes(r) == [(5, ReleaseCause.DP_DEFERRED, ReleaseMode.RETRACT)]


def test_an_adoption_that_paused_dp_work_distrusts_its_members_and_is_released_after_max_defer_s():
    """The workers bound hard instead of adopting (a member lacked KV for the slices it would receive): the
    members report the DP work they paused. The group is a hard bind's from then on, and its block does not adopt
    (and pause the same work) again at once after the release."""
    light = LIGHT
    members = [
        eng(0, epoch=5, inflight=106, kvt=True, paused=106),
        eng(1, epoch=5, inflight=106, kvt=True, paused=106),
    ]
    r = rnd([group(reason="load", state="binding", adopt=True)], members, state=light)
    reconcile(r)
    assert r.out.put[5].state == "bound" and r.suspect == {
        0: 100.0 + UNIT_LIMITS.suspect_s,
        1: 100.0 + UNIT_LIMITS.suspect_s,
    }
    assert DistrustNote((0, 1), UNIT_LIMITS.suspect_s, paused=212) in r.out.events
    assert "adoption paused 212 DP requests" in str(r.out.events[-1])
    release_groups(r)
    assert not r.out.commands, "paused for less than max_defer_s"
    g = group(reason="load", since=100.0 - UNIT_LIMITS.max_defer_s, adopt=True)
    r = rnd([g], members, state=planned(2, suspect={0: 105.0, 1: 105.0}))
    reconcile(r)
    assert not r.out.events, "distrusted once, not every round"
    release_groups(r)
    assert causes(r) == [(5, ReleaseCause.DP_DEFERRED, ReleaseMode.SCATTER)]
    adopted = [eng(0, epoch=5, inflight=106, kvt=True), eng(1, epoch=5, inflight=106, kvt=True)]
    r = rnd([g], adopted, state=light)
    reconcile(r)
    release_groups(r)
    assert not r.out.commands and not r.suspect, "the same numbers, adopted: TP requests, nothing paused"


def test_making_room_releases_the_idle_groups_of_one_block():
    groups = [group(5, (0, 1)), group(6, (2, 3), reason="load")]
    r = rnd(groups, [eng(0, epoch=5), eng(1, epoch=5), eng(2, epoch=6), eng(3, epoch=6)])
    release_idle_blocking(r, 4)
    assert [(n.epoch, n.cause, n.width) for n in r.out.releases] == [
        (5, ReleaseCause.MAKING_ROOM, 4),
        (6, ReleaseCause.MAKING_ROOM, 4),
    ]
    r = rnd(groups, [eng(0, epoch=5), eng(1, epoch=5), eng(2, epoch=6), eng(3, epoch=6)], loads={6: GroupLoad(1, 10, 10)})  # fmt: skip
    release_idle_blocking(r, 4)
    assert not r.out.commands, "one of them is busy"
