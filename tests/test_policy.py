"""The pure bind/release policy: one test per rule, on hand-made snapshots."""

from __future__ import annotations

import dataclasses
import re

import msgspec
import pytest

from flying.messages import Bind, Group, QueuedRequest, Release, RouterState
from flying.prefix import BLOCK, block_hashes, encode_chain
from router import policy
from router.config import Limits
from router.policy import Decision, EngineView, GroupLoad, PolicyConfig, Snapshot, need_width
from router.prefix_index import PrefixIndex
from tests.policy_settings import (
    BUSY,
    DP_ONLY,
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
DP8 = Limits(max_inflight_per_worker=8)  # DP_ONLY's tests: 8 requests an engine


def decide(s: Snapshot, cfg: PolicyConfig, limits: Limits | None = None) -> Decision:
    """The policy's round on ``s`` within ``limits`` (DP_ONLY: :data:`DP8`; otherwise the unit limits)."""
    if limits is None:
        limits = DP8 if cfg.off >= DP_ONLY.off else UNIT_LIMITS
    return policy.decide(dataclasses.replace(s, limits=limits), cfg)


def req(
    i: str, prompt: int = 10, out: int = 10, priority: str = "normal", at: float = 100.0
) -> QueuedRequest:
    return QueuedRequest(
        id=i, priority=priority, model="m", prompt_tokens=prompt, max_tokens=out, gateway="g", enqueued_at=at
    )


def eng(i: int, inflight: int = 0, cap: int = 1000, n: int = 4, **kw) -> EngineView:
    return EngineView(i, f"http://e{i}", inflight, cap, cap, num_engines=n, beat_ts=kw.pop("ts", 100.0), **kw)


def snap(waiting=(), engines=None, groups=(), state=BUSY, now=100.0, loads=None, queued=None) -> Snapshot:
    engines = [eng(i) for i in range(4)] if engines is None else engines
    return Snapshot(
        now=now,
        waiting=list(waiting),
        queued=len(waiting) if queued is None else queued,
        engines=engines,
        groups=list(groups),
        tp_load=loads or {},
        state=state,
    )


def bound(epoch, members, reason="priority", since=99.0, last_used=99.0, state="bound") -> Group:
    return Group(epoch=epoch, members=members, reason=reason, state=state, since=since, last_used=last_used)


def in_epoch(i, epoch, **kw) -> EngineView:
    return eng(i, mode="tp", epoch=epoch, **kw)


# --- DP dispatch -----------------------------------------------------------------------------------------------


def test_spreads_requests_over_least_loaded_engines():
    d = decide(snap([req("a"), req("b"), req("c")], [eng(0, inflight=1), eng(1)]), DP_ONLY)
    assert [(x.request.id, x.engine, x.epoch) for x in d.dispatches] == [
        ("a", 1, 0),
        ("b", 0, 0),
        ("c", 1, 0),
    ]


def test_a_request_that_failed_on_an_engine_goes_elsewhere_unless_that_engine_is_the_only_one():
    retry = msgspec.structs.replace(req("a"), failed_on=0, attempts=1)
    d = decide(snap([retry], [eng(0), eng(1, inflight=5)]), DP_ONLY)
    assert [(x.request.id, x.engine) for x in d.dispatches] == [("a", 1)], (
        "its heartbeat may not have expired"
    )
    full = Limits(max_inflight_per_worker=5)
    assert not decide(snap([retry], [eng(0), eng(1, inflight=5)]), DP_ONLY, full).dispatches, (
        "it waits for another"
    )
    assert [x.engine for x in decide(snap([retry], [eng(0)]), DP_ONLY).dispatches] == [0]
    g = bound(7, (0, 1), reason="manual")  # engine 2 is full: traffic flows through the operator's group ...
    engines = [in_epoch(0, 7), in_epoch(1, 7), eng(2, inflight=8)]
    assert [x.epoch for x in decide(snap([req("b")], engines, [g]), DP_ONLY).dispatches] == [7]
    assert not decide(snap([retry], engines, [g]), DP_ONLY).dispatches, "... but not one it failed in"


def test_respects_the_inflight_cap_and_keeps_queue_order():
    d = decide(
        snap([req("a"), req("b"), req("c")], [eng(0, inflight=1)]), DP_ONLY, Limits(max_inflight_per_worker=2)
    )
    assert [x.request.id for x in d.dispatches] == ["a"]


def test_request_too_big_for_one_engine_without_groups_waits_but_does_not_block_others():
    d = decide(snap([req("big", prompt=5000), req("small")], [eng(0, n=1)]), DP_ONLY)
    assert [x.request.id for x in d.dispatches] == ["small"] and not d.binds


def test_no_engines_no_dispatch():
    assert decide(snap([req("a")], []), CFG).dispatches == []


def test_bound_and_grouped_engines_get_no_dp_work():
    g = bound(7, (0, 1))
    engines = [in_epoch(0, 7), in_epoch(1, 7), eng(2, inflight=3), eng(3, pending=9)]
    d = decide(snap([req("a")], engines, [g]), DP_ONLY)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(2, 0)]


# --- long context ----------------------------------------------------------------------------------------------


def test_need_width_is_the_smallest_group_whose_pooled_kv_fits():
    es = [eng(i, cap=1000) for i in range(4)]
    assert need_width(900, es) == 1
    assert need_width(1500, es) == 2
    assert need_width(3000, es) == 4
    assert need_width(4001, es) is None
    assert need_width(1500, [eng(0, n=1)]) is None


def test_long_request_binds_the_smallest_fitting_group_then_goes_to_its_leader():
    """Under load (a deep queue: not calm) once its wait is over (long_wait_s 0); calm binds wider
    (tests/test_long_wait.py)."""
    cfg = dataclasses.replace(CFG, long_wait_s=0.0, preempt="sequential")
    long = req("long", prompt=1400, out=100)
    d = decide(snap([long], queued=10), cfg)
    assert [(g.members, g.reason, g.preempt) for g in d.binds] == [((0, 1), "long", "sequential")]
    assert d.dispatches == []  # it waits for the group
    g = bound(5, (0, 1), reason="long", state="binding")
    d = decide(snap([long], [in_epoch(0, 5), in_epoch(1, 5), eng(2), eng(3)], [g], queued=10), cfg)
    assert d.put[5].state == "bound"
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 5)]
    assert not d.binds


def test_long_request_reuses_a_wider_bound_group_instead_of_binding():
    g = bound(3, (0, 1, 2, 3), reason="manual")
    d = decide(snap([req("long", prompt=1500)], [in_epoch(i, 3) for i in range(4)], [g], state=LIGHT), CFG)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 3)] and not d.binds


def test_long_request_that_fits_no_group_is_left_queued():
    d = decide(snap([req("huge", prompt=5000)]), CFG)
    assert not d.dispatches and not d.binds


def test_long_request_blocked_by_idle_groups_releases_them_to_make_room():
    g1, g2 = bound(1, (0, 1)), bound(2, (2, 3))
    engines = [in_epoch(0, 1), in_epoch(1, 1), in_epoch(2, 2), in_epoch(3, 2)]
    d = decide(snap([req("long", prompt=3000)], engines, [g1, g2], now=99.5), CFG)
    assert sorted(d.put) == [1, 2] and all(g.state == "releasing" for g in d.put.values())
    assert sorted(c.epoch for _, c in d.commands) == [1, 2]


def test_high_priority_request_takes_an_idle_long_group_when_no_engine_is_in_dp():
    """Found by the simulator's random sequences: every engine in an idle long group, a high-priority request
    waiting. The groups are kept while it waits (it would go to a group), so it must take one, not wait forever."""
    g1, g2 = bound(1, (0, 1), reason="long"), bound(2, (2, 3), reason="long")
    engines = [in_epoch(0, 1), in_epoch(1, 1), in_epoch(2, 2), in_epoch(3, 2)]
    d = decide(snap([req("hi", priority="high")], engines, [g1, g2], state=LIGHT), CFG)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 1)]
    assert d.put[1].reason == "priority" and not d.commands and not d.binds


def test_a_hard_bound_group_without_paused_dp_work_offers_its_whole_kv():
    """Found by the simulator's random sequences: a long group hard-bound while its members held DP work has a KV
    cap; once that work is gone the cap must not keep out a long request the members' KV holds (the idle group is
    kept for that request, which would otherwise wait forever)."""
    g = msgspec.structs.replace(bound(1, (0, 1), reason="long"), kv_cap=1500)
    engines = [in_epoch(0, 1), in_epoch(1, 1), eng(2, inflight=1), eng(3, inflight=1)]
    long = req("long", prompt=1800)
    d = decide(snap([long], engines, [g], state=LIGHT), CFG)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 1)]
    paused = [in_epoch(0, 1, inflight=2), in_epoch(1, 1)] + engines[2:]  # two paused DP requests on engine 0
    assert not decide(snap([long], paused, [g], state=LIGHT), CFG).dispatches


def test_a_hard_long_bind_counts_the_dp_work_sent_to_its_members_in_the_same_round():
    """Found by the simulator's random sequences: a DP request sent to engine 0 in the same round as a hard long
    bind over (0, 1) pauses there holding KV the snapshot did not show; counted, the long request no longer fits
    the hard cap and the bind is sequential (before: the group formed too small to ever start it)."""
    cfg = dataclasses.replace(CFG, preempt="hard", long_wait_s=0.0)  # under load (queued): its need
    engines = [eng(0), eng(1), eng(2, inflight=3), eng(3, inflight=3)]
    long = req("long", prompt=1700)
    assert decide(snap([long], engines, queued=10), cfg).binds[0].preempt == "hard"  # alone: the cap holds it
    d = decide(snap([req("small", prompt=290), long], engines, queued=10), cfg)
    assert [(x.request.id, x.engine) for x in d.dispatches] == [("small", 0)]
    assert [(g.members, g.preempt) for g in d.binds] == [((0, 1), "sequential")]


def test_long_context_off_leaves_long_requests_alone():
    cfg = off("long-context")
    d = decide(snap([req("long", prompt=1500)]), cfg)
    assert not d.binds and not d.dispatches and d.state.long_context is False


# --- priority --------------------------------------------------------------------------------------------------


def test_high_priority_under_light_load_binds_the_least_loaded_block_with_hard_preemption():
    engines = [eng(0, inflight=5), eng(1, inflight=5), eng(2, inflight=1), eng(3)]
    d = decide(snap([req("hi", priority="high"), req("n")], engines, state=LIGHT_NO_LOAD), CFG)
    assert [(g.members, g.reason, g.preempt) for g in d.binds] == [((2, 3), "priority", "hard")]
    assert [(x.request.id, x.engine) for x in d.dispatches] == [("n", 0)]  # not onto the engines being bound


def test_high_priority_under_busy_load_binds_only_idle_engines_else_jumps_the_queue_in_dp():
    busy = [eng(0, inflight=5), eng(1, inflight=5), eng(2, inflight=1), eng(3)]
    d = decide(snap([req("hi", priority="high"), req("n")], busy), CFG)
    assert not d.binds  # pausing engine 2's request costs more than the group saves
    assert [(x.request.id, x.engine, x.epoch) for x in d.dispatches] == [("hi", 3, 0), ("n", 2, 0)]
    idle = [eng(0, inflight=5), eng(1, inflight=5), eng(2), eng(3)]
    d = decide(snap([req("hi", priority="high")], idle), CFG)
    assert [g.members for g in d.binds] == [(2, 3)]


def test_second_high_request_waits_for_the_binding_group_instead_of_binding_another():
    g = bound(4, (2, 3), state="binding", since=100.0)
    d = decide(snap([req("h1", priority="high"), req("h2", priority="high")], groups=[g]), CFG)
    assert not d.binds and not d.dispatches


def test_high_priority_reuses_the_bound_group_up_to_its_capacity():
    one = unit_limits(tp_inflight_per_engine=1, sp_inflight_per_engine=1)
    g = bound(4, (2, 3))
    engines = [eng(0), eng(1), in_epoch(2, 4), in_epoch(3, 4)]
    d = decide(snap([req(f"h{i}", priority="high") for i in range(3)], engines, [g]), CFG, one)
    assert [(x.request.id, x.engine, x.epoch) for x in d.dispatches[:2]] == [("h0", 2, 4), ("h1", 2, 4)]
    assert not d.binds and d.dispatches[2].epoch == 0  # another group would take the last DP engines: DP


def test_high_priority_falls_back_to_dp_when_no_group_can_form():
    engines = [eng(0), eng(1, n=1)]  # engine 1 cannot bind: no merge set is free
    d = decide(snap([req("hi", priority="high")], engines), CFG)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 0)] and not d.binds


def test_priority_off_sends_high_requests_to_dp():
    cfg = off("priority")
    d = decide(snap([req("hi", priority="high")]), cfg)
    assert not d.binds and d.dispatches[0].epoch == 0


def test_idle_priority_group_is_kept_for_keep_s_then_released_under_load():
    g = bound(4, (2, 3), last_used=100.0)
    engines = [eng(0), eng(1), in_epoch(2, 4), in_epoch(3, 4)]
    assert not decide(snap(engines=engines, groups=[g], now=100.5, state=planned(1, now=100.5)), CFG).commands
    d = decide(snap(engines=engines, groups=[g], now=101.1, state=planned(1, now=101.1)), CFG)
    assert d.commands == [((2, 3), Release(epoch=4))] and d.put[4].state == "releasing"


def test_group_with_tp_work_is_not_released_for_idleness():
    g = bound(4, (2, 3), last_used=90.0, since=99.0)
    engines = [eng(0), eng(1), in_epoch(2, 4, inflight=1), in_epoch(3, 4)]
    d = decide(snap(engines=engines, groups=[g], loads={4: GroupLoad(1, 20)}), CFG)
    assert not d.commands


def test_deferred_dp_work_bounds_how_long_a_group_stays_bound():
    """Members hold paused DP requests (inflight beyond the group's TP requests): after max_defer_s the group is
    released even though TP work keeps coming."""
    g = bound(4, (2, 3), since=100.0, last_used=104.9)
    engines = [eng(0), eng(1), in_epoch(2, 4, inflight=3), in_epoch(3, 4, inflight=2)]
    loads = {4: GroupLoad(1, 20)}
    assert not decide(snap(engines=engines, groups=[g], loads=loads, now=104.0), CFG).commands
    d = decide(snap([req("hi", priority="high")], engines, [g], loads=loads, now=105.1), CFG)
    assert d.commands == [((2, 3), Release(epoch=4, retract=True))]  # the paused DP work resumes at once
    assert all(x.epoch != 4 for x in d.dispatches)  # a releasing group takes no new work


# --- load adaptation -------------------------------------------------------------------------------------------


def test_light_load_sends_normal_requests_to_load_groups():
    g = bound(1, (0, 1), reason="load")
    engines = [in_epoch(0, 1), in_epoch(1, 1), eng(2, inflight=1), eng(3, inflight=1)]
    d = decide(snap([req("a")], engines, [g], state=LIGHT), CFG)
    assert [(x.engine, x.epoch) for x in d.dispatches] == [(0, 1)]


def test_light_load_binds_idle_blocks_at_once_and_drains_at_most_half_of_the_others():
    """An idle block binds hard (nothing to pause); busy blocks drain first (sequential: nothing is paused or
    recomputed), at most half of the blocks still in DP at a time, least loaded first."""
    loads = [0, 0, 1, 0, 0, 1, 2, 1]
    engines = [eng(i, n=8, inflight=x) for i, x in enumerate(loads)]
    d = decide(snap(engines=engines, state=LIGHT), CFG)
    got = [(g.members, g.preempt) for g in d.binds]
    assert got == [((0, 1), "hard"), ((2, 3), "sequential"), ((4, 5), "sequential")]


def test_light_load_keeps_new_dp_work_off_draining_blocks():
    engines = [eng(0, inflight=1), eng(1), eng(2, inflight=3), eng(3, inflight=2)]
    draining = msgspec.structs.replace(bound(1, (0, 1), state="binding", reason="load"), preempt="sequential")
    d = decide(snap([req("a")], engines, [draining], state=LIGHT), CFG)
    assert [x.engine for x in d.dispatches] == [3]  # not engine 1, though idle: it drains for the group


def test_waiting_normal_request_means_busy_and_releases_load_groups():
    g = bound(1, (0, 1), reason="load")
    engines = [in_epoch(0, 1, inflight=8), in_epoch(1, 1), eng(2, inflight=32), eng(3, inflight=32)]
    waiting = [req("old", at=99.5)]
    d = decide(snap(waiting, engines, [g], state=BUSY, loads={1: GroupLoad(8, 100, 20)}), CFG)
    assert d.state.busy and d.commands == [((0, 1), Release(epoch=1, retract=True))]  # they continue in DP
    d = decide(snap(waiting, engines, [g], state=BUSY, loads={1: GroupLoad(8, 1900, 1500)}), CFG)
    # a long one cannot: the group stays bound, taking the work DP has no room for, until the long one ends
    assert d.state.busy and not d.commands and d.put.get(1, g).state == "bound"
    assert [(x.request.id, x.epoch) for x in d.dispatches] == [("old", 1)]


def test_idle_priority_group_of_the_planned_width_becomes_a_load_group():
    g = bound(4, (0, 1), last_used=90.0)
    engines = [in_epoch(0, 4), in_epoch(1, 4), eng(2), eng(3)]
    d = decide(snap(engines=engines, groups=[g], state=LIGHT), CFG)
    assert d.put[4].reason == "load" and not d.commands


def test_load_groups_off_binds_none_though_the_planner_judges_the_load():
    cfg = off("load")
    d = decide(snap(now=1000.0, state=RouterState(busy=True)), cfg)
    assert not d.binds and d.state.widths == {"0": 1}
    assert not d.state.busy, (
        "idle: the planner predicts a group serves better (priority groups may take engines)"
    )


# --- group records and safety -----------------------------------------------------------------------------------


def test_unacknowledged_bind_is_rolled_back_after_ack_timeout():
    g = bound(6, (0, 1), state="binding", since=100.0)
    engines = [eng(0, pending=6), eng(1)]  # engine 1 never read the bind
    assert not decide(snap(engines=engines, groups=[g], now=101.0), CFG).commands
    d = decide(snap(engines=engines, groups=[g], now=102.5), CFG)
    assert d.commands == [((0, 1), Release(epoch=6))] and d.put[6].state == "releasing"


def test_acknowledged_but_slow_bind_waits_until_bind_timeout():
    g = bound(6, (0, 1), state="binding", since=100.0, reason="long")
    engines = [eng(0, pending=6), eng(1, pending=6)]  # sequential: draining DP work
    assert not decide(snap(engines=engines, groups=[g], now=150.0), CFG).commands
    assert decide(snap(engines=engines, groups=[g], now=161.0), CFG).commands == [((0, 1), Release(epoch=6))]


def test_group_with_a_dead_member_is_released():
    g = bound(6, (0, 1))
    d = decide(snap(engines=[in_epoch(0, 6), eng(2), eng(3)], groups=[g]), CFG)
    assert d.commands == [((0, 1), Release(epoch=6))]


def test_group_whose_member_aborted_the_epoch_is_released():
    g = bound(6, (0, 1))
    d = decide(snap(engines=[in_epoch(0, 6), eng(1), eng(2), eng(3)], groups=[g]), CFG)
    assert d.put[6].state == "releasing"


def test_releasing_record_is_dropped_only_after_fresh_heartbeats_show_dp():
    g = bound(6, (0, 1), state="releasing", since=100.0)
    stale = [eng(0, ts=99.9), eng(1, ts=100.2)]
    assert decide(snap(engines=stale, groups=[g]), CFG).drop == []
    still = [in_epoch(0, 6, ts=100.3), eng(1, ts=100.2)]
    assert decide(snap(engines=still, groups=[g]), CFG).drop == []
    fresh = [eng(0, ts=100.3), eng(1, ts=100.2)]
    d = decide(snap(engines=fresh, groups=[g]), CFG)
    assert d.drop == [6] and 6 not in d.put


def test_new_binds_never_overlap_existing_or_each_other():
    groups = [bound(1, (0, 1), state="releasing", since=100.5)]  # heartbeats older than the release
    engines = [eng(i, n=8) for i in range(8)]
    waiting = [req(f"h{i}", priority="high") for i in range(5)]
    d = decide(snap(waiting, engines, groups), CFG)
    members = [m for g in d.binds for m in g.members]
    assert len(members) == len(set(members)) and not set(members) & {0, 1}
    assert [g.members for g in d.binds] == [(2, 3), (4, 5)]  # (6, 7) stay DP for everyone else


def test_bind_command_carries_the_records_epoch():
    g = msgspec.structs.replace(bound(9, (2, 3)), preempt="sequential")
    members, cmd = decide(snap(), CFG).bind_command(g)
    assert members == (2, 3) and cmd == Bind(epoch=9, members=(2, 3), preempt="sequential")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(max_width=3), "max_width must be a power of two >= 1, got 3"),
        (dict(preempt="soft"), "preempt must be one of hard, sequential, got 'soft'"),
        (dict(off=frozenset({"parking"})), "off: unknown mechanism parking"),
        (dict(tpot_target_ms=0), "tpot_target_ms must be > 0"),
    ],
)
def test_config_is_validated(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PolicyConfig(**bad)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(ack_timeout_s=0), "need 0 < ack_timeout_s <= bind_timeout_s"),
        (dict(max_inflight_per_worker=0), "max_inflight_per_worker must be >= 1"),
        (dict(suspect_s=-1), "suspect_s must be >= 0"),
    ],
)
def test_limits_are_validated(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Limits(**bad)


def test_priority_group_never_takes_the_last_dp_engines():
    d = decide(snap([req("hi", priority="high")], [eng(0, n=2), eng(1, n=2)]), CFG)
    assert not d.binds and [(x.engine, x.epoch) for x in d.dispatches] == [(0, 0)]


# --- KV transformation: adoption and scatter (issue 12) ---------------------------------------------------------

KVT = dict(kv_transform=True)


RATE = CFG


def rate_state(rate: float, busy: bool, admitted: int = 1000, ts: float = 99.9, **kw) -> RouterState:
    """The planner chose DP (``busy``) or width 2 a moment ago, at ``rate`` admissions a second."""
    return planned(1 if busy else 2, rate=rate, rate_ts=ts, admitted=admitted, **kw)


def teng(i: int, inflight: int = 0, used: int = 0, cap: int = 100_000, n: int = 4, **kw) -> EngineView:
    """An engine that applies adopt/scatter, holding ``used`` KV tokens of DP requests."""
    return EngineView(
        i, f"http://e{i}", inflight, cap - used, cap, num_engines=n, beat_ts=kw.pop("ts", 100.0), **KVT, **kw
    )


def tin_epoch(i, epoch, **kw) -> EngineView:
    return teng(i, mode="tp", epoch=epoch, **kw)


def test_light_load_adopts_busy_blocks_at_once_instead_of_draining_them():
    """Before: a busy block drained first (sequential; at most half of them at a time). Now every block binds at
    the next step boundary by adoption: its DP requests become the group's, nothing waits or is recomputed."""
    engines = [teng(i, n=8, inflight=x, used=2000 * x) for i, x in enumerate([0, 0, 1, 0, 0, 1, 2, 1])]
    d = decide(snap(engines=engines, state=LIGHT), CFG)
    got = [(g.members, g.preempt, g.adopt) for g in d.binds]
    assert got == [
        ((0, 1), "hard", False),
        ((2, 3), "hard", True),
        ((4, 5), "hard", True),
        ((6, 7), "hard", True),
    ]
    members, cmd = d.bind_command(msgspec.structs.replace(d.binds[1], epoch=9))
    assert cmd == Bind(epoch=9, members=(2, 3), preempt="hard", adopt=True)
    assert any("adoption" in n for n in d.notes)


def test_adoption_needs_every_member_to_report_kv_transform_and_the_config_to_allow_it():
    mixed = [teng(0, inflight=1, used=2000), eng(1, inflight=1), eng(2, inflight=3), eng(3, inflight=3)]
    d = decide(snap(engines=mixed, state=LIGHT), CFG)
    assert [(g.members, g.preempt, g.adopt) for g in d.binds] == [((0, 1), "sequential", False)]
    both = [teng(i, inflight=x, used=2000 * x) for i, x in enumerate([1, 1, 3, 3])]
    no_kvt = off("kv-transform")
    assert [(g.preempt, g.adopt) for g in decide(snap(engines=both, state=LIGHT), no_kvt).binds] == [
        ("sequential", False)
    ]


def test_adoption_whose_transformation_costs_more_than_adopt_max_ms_drains_instead(monkeypatch):
    """Transformation-aware: a block holding much KV would stall its group for its head slices' transfer
    (here about 100 K tokens x 160 KB / 2 at 360 GB/s = 23 ms + 4 ms fixed); above the budget it drains as before.
    (Each member has room for the slices it would receive: 300 K tokens free.)"""
    engines = [teng(i, inflight=4, used=100_000, cap=400_000) for i in range(4)]
    assert all(g.adopt for g in decide(snap(engines=engines, state=LIGHT), CFG).binds)
    monkeypatch.setattr("router.transform_cost.ADOPT_MAX_MS", 20.0)
    d = decide(snap(engines=engines, state=LIGHT), CFG)
    assert [(g.preempt, g.adopt) for g in d.binds] == [("sequential", False)]


def test_a_block_holding_a_backlog_is_not_adopted_it_serves_it_in_dp():
    eight = unit_limits(adopt_max_inflight=8)
    engines = [teng(0, inflight=2), teng(1, inflight=3), teng(2, inflight=9), teng(3, inflight=9)]
    d = decide(snap([req("a")], engines, state=rate_state(2.0, busy=False)), RATE, eight)
    assert [(g.members, g.adopt) for g in d.binds] == [((0, 1), True)]  # (2, 3) hold 18 > 2 x 8: they stay DP
    assert [x.engine for x in d.dispatches] == [2]  # (and keep taking DP work while no group has room)


def test_load_groups_release_by_scatter_when_load_rises():
    """Before: released by retraction (the leader recomputes the TP requests). Now by scatter: each continues in DP
    on its owner with its KV."""
    g = bound(1, (0, 1), reason="load")
    engines = [tin_epoch(0, 1, inflight=8), tin_epoch(1, 1), teng(2, inflight=32), teng(3, inflight=32)]
    waiting = [req("old", at=99.5)]
    d = decide(snap(waiting, engines, [g], state=BUSY, loads={1: GroupLoad(8, 100, 20)}), CFG)
    assert d.state.busy and d.commands == [((0, 1), Release(epoch=1, scatter=True))]
    assert any("by scatter" in n for n in d.notes)
    # a request that needs the pooled KV cannot go back to one engine: the group stays, serving, until it ends
    d = decide(snap(waiting, engines, [g], state=BUSY, loads={1: GroupLoad(8, 190_000, 150_000)}), CFG)
    assert d.state.busy and not d.commands and d.put.get(1, g).state == "bound"


def test_scatter_is_gated_on_kv_transform_and_an_adopted_group_never_retracts():
    """A member without kv_transform: no scatter. A group that holds no adopted requests retracts as before; one
    bound by adoption waits for its requests (their streams are on their owners: the leader cannot retract them)."""
    engines = [tin_epoch(0, 1, inflight=8), in_epoch(1, 1), teng(2, inflight=32), teng(3, inflight=32)]
    waiting, loads = [req("old", at=99.5)], {1: GroupLoad(8, 100, 20)}
    g = bound(1, (0, 1), reason="load")
    d = decide(snap(waiting, engines, [g], state=BUSY, loads=loads), CFG)
    assert d.commands == [((0, 1), Release(epoch=1, retract=True))]
    adopted = msgspec.structs.replace(g, adopt=True)
    d = decide(snap(waiting, engines, [adopted], state=BUSY, loads=loads), CFG)
    assert d.commands == [((0, 1), Release(epoch=1))]


def test_priority_bind_under_light_load_adopts_the_blocks_dp_work_instead_of_pausing_it():
    engines = [teng(0, inflight=5), teng(1, inflight=5), teng(2, inflight=1, used=3000), teng(3)]
    d = decide(snap([req("hi", priority="high"), req("n")], engines, state=LIGHT_NO_LOAD), CFG)
    assert [(g.members, g.reason, g.adopt) for g in d.binds] == [((2, 3), "priority", True)]
    d = decide(snap([req("hi", priority="high"), req("n")], engines, state=LIGHT), CFG)
    assert [(g.members, g.reason) for g in d.binds] == [((2, 3), "load"), ((0, 1), "load")], (
        "a node planned bound: its load groups take the high-priority request"
    )
    assert d.binds[0].kv_cap > 0  # its adopted requests hold KV: the group's cap counts them


def test_a_group_bound_by_adoption_pauses_nothing_so_max_defer_s_does_not_release_it():
    """Its members' requests beyond the dispatched TP ones are adopted TP requests, not paused DP work: no deferral
    release, and the group is busy (not released as idle) while they run."""
    g = msgspec.structs.replace(bound(4, (2, 3), since=100.0, last_used=100.0), adopt=True)
    engines = [teng(0), teng(1), tin_epoch(2, 4, inflight=3), tin_epoch(3, 4, inflight=2)]
    loads = {4: GroupLoad(1, 20)}
    assert not decide(snap(engines=engines, groups=[g], loads=loads, now=106.0), CFG).commands
    assert not decide(snap(engines=engines, groups=[g], loads={}, now=106.0), CFG).commands
    paused = msgspec.structs.replace(g, adopt=False)  # the same numbers after a hard bind: paused work
    assert decide(snap(engines=engines, groups=[paused], loads=loads, now=106.0), CFG).commands


def test_dp_work_an_adoption_paused_resumes_and_the_block_does_not_adopt_it_again_at_once():
    """Two engines ending a burst adopt their backlog under light load, but the workers find a member short of KV
    and bind hard: 212 requests paused, reported in the heartbeats. Counted as the group's adopted requests they
    kept it busy and never deferred, so they waited forever. Now the group is released after max_defer_s (by
    scatter) and the block serves its backlog in DP for suspect_s before it may adopt again."""
    cfg, lim = RATE, unit_limits(adopt_max_inflight=128)  # the default: 106 a member may be adopted
    light = planned(2, now=100.5)  # (each round below: the planner keeps the pair bound)

    def at(state: RouterState, now: float) -> RouterState:
        return msgspec.structs.replace(state, planned_at=now, widths={"0": 2}, busy=False)

    g = msgspec.structs.replace(bound(4, (0, 1), reason="load", since=100.0, last_used=100.0), adopt=True)
    paused = [tin_epoch(i, 4, n=2, inflight=106, used=4000, paused=106) for i in (0, 1)]
    d = decide(snap(engines=paused, groups=[g], state=light, now=100.5), cfg, lim)
    assert not d.commands and set(d.state.suspect) == {0, 1}
    d = decide(snap(engines=paused, groups=[g], state=at(d.state, 105.0), now=105.0), cfg, lim)
    assert d.commands == [((0, 1), Release(epoch=4, scatter=True))]
    in_dp = [teng(i, n=2, inflight=106, used=4000) for i in (0, 1)]
    assert not decide(snap(engines=in_dp, state=at(d.state, 106.0), now=106.0), cfg, lim).binds, "distrusted"
    trusted = msgspec.structs.replace(at(d.state, 106.0), suspect={})
    assert [x.adopt for x in decide(snap(engines=in_dp, state=trusted, now=106.0), cfg, lim).binds] == [True]


def test_adopted_requests_do_not_take_the_groups_room():
    lim = unit_limits(tp_inflight_per_engine=1, sp_inflight_per_engine=1, adopt_max_inflight=4)
    g = msgspec.structs.replace(bound(4, (0, 1), reason="load"), adopt=True)
    engines = [
        tin_epoch(0, 4, inflight=6),
        tin_epoch(1, 4, inflight=6),
        teng(2, inflight=9),
        teng(3, inflight=9),
    ]
    d = decide(
        snap([req("a"), req("b"), req("c")], engines, [g], state=rate_state(2.0, busy=False)), RATE, lim
    )
    assert [x.epoch for x in d.dispatches] == [4, 4, 0]  # two TP requests (width x 1), then DP


def test_long_request_adopts_where_hard_preemption_would_pause():
    cfg = dataclasses.replace(CFG, preempt="hard", long_wait_s=0.0)  # under load (queued): its need
    engines = [teng(i, inflight=1, used=1000, cap=100_000) for i in range(4)]
    long = req("long", prompt=150_000, out=100)
    d = decide(snap([long], engines, queued=10), cfg)
    assert [(g.members, g.reason, g.preempt, g.adopt) for g in d.binds] == [((0, 1), "long", "hard", True)]
    drain = dataclasses.replace(cfg, preempt="sequential")
    assert [g.adopt for g in decide(snap([long], engines, queued=10), drain).binds] == [False]  # it drains


# --- the rate regime and hysteresis ------------------------------------------------------------------------------


def test_recent_dispatches_count_twice_so_a_fresh_engine_does_not_take_everything(monkeypatch):
    """A released group's follower has nothing in flight (its leader owns the group's requests): least-loaded
    dispatch would send it every new request, all prefilling at once. Recent ones count twice (SPREAD_S)."""
    engines = [teng(0, inflight=4), teng(1), teng(2, inflight=3), teng(3, inflight=3)]
    waiting = [req(c) for c in "abcdef"]
    monkeypatch.setattr("router.round.SPREAD_S", 0.0)
    plain = decide(snap(waiting, engines), CFG)
    assert [x.engine for x in plain.dispatches] == [1, 1, 1, 1, 2, 3]
    monkeypatch.setattr("router.round.SPREAD_S", 2.0)
    d = decide(snap(waiting, engines), CFG)
    assert [x.engine for x in d.dispatches] == [1, 1, 2, 3, 0, 1]
    assert d.state.recent == {1: 3.0, 2: 1.0, 3: 1.0, 0: 1.0}
    later = decide(snap([], engines, state=d.state, now=102.0), CFG)  # decayed by e^-1 (rate_ts: 100)
    assert later.state.recent[1] == pytest.approx(3.0 * 0.3679, rel=1e-3)


# --- fast path ---------------------------------------------------------------------------------------------------


def test_fast_targets_follow_where_a_short_request_would_go():
    """Busy: every DP engine outside a group, capped at the per-worker slots. Light with a bound load group: its
    leader, capped at the group's room. A group forming (requests wait for it): none."""
    g = bound(7, (0, 1), reason="manual")
    d = decide(snap([], [in_epoch(0, 7), in_epoch(1, 7), eng(2, inflight=3), eng(3)], [g]), DP_ONLY)
    assert [(t.engine, t.epoch, t.cap, t.max_kv) for t in d.fast] == [(2, 0, 8, 1000), (3, 0, 8, 1000)]
    load = bound(5, (0, 1), reason="load")
    engines = [in_epoch(0, 5, inflight=1, n=2), in_epoch(1, 5, n=2)]  # (no idle block left to bind)
    d = decide(snap([], engines, [load], state=LIGHT, loads={5: GroupLoad(1, 20, 20)}), CFG)
    (t,) = d.fast
    room = 2 * UNIT_LIMITS.tp_inflight_per_engine - 1
    assert (t.engine, t.epoch, t.cap, t.max_kv) == (
        0,
        5,
        1 + room,
        1000,
    )  # one engine's: a long one waits a round
    forming = bound(5, (0, 1), reason="load", state="binding")
    assert not decide(snap([], [eng(i) for i in range(4)], [forming], state=LIGHT), CFG).fast
    assert decide(snap([], [eng(i) for i in range(4)], [], state=LIGHT), CFG).binds, "idle blocks bind ..."
    assert not decide(snap([], [eng(i) for i in range(4)], [], state=LIGHT), CFG).fast, "... so requests wait"


def test_a_group_with_tp_requests_in_flight_counts_as_used():
    """Requests the admission fast path sent a group never pass through a round: while the group has TP requests
    in flight its last use is now, so it is not released keep_s after the round's last dispatch."""
    load = bound(5, (0, 1), reason="load", last_used=10.0)
    engines = [in_epoch(0, 5, inflight=1, n=2), in_epoch(1, 5, n=2)]
    d = decide(snap([], engines, [load], state=LIGHT, loads={5: GroupLoad(1, 20, 20)}), CFG)
    assert d.put[5].last_used == 100.0 and not d.commands


# --- cache-aware DP dispatch (issue 16) ----------------------------------------------------------------------

SYSTEM = list(range(1000, 1000 + 8 * BLOCK))  # an 8-block system prompt


def creq(i: str, tokens: list[int]) -> QueuedRequest:
    return msgspec.structs.replace(req(i, prompt=len(tokens)), prefix=encode_chain(block_hashes(tokens)))


def index_with(engines: list[EngineView], sent: dict[int, list[list[int]]]) -> PrefixIndex:
    idx = PrefixIndex()
    idx.sync(engines)
    for e, prompts in sent.items():
        for tokens in prompts:
            idx.record(e, block_hashes(tokens))
    return idx


def test_cache_aware_sends_a_request_to_the_engine_holding_the_longest_prefix():
    engines = [eng(0), eng(1, inflight=3), eng(2, inflight=3)]
    turn1 = SYSTEM + list(range(2 * BLOCK))
    idx = index_with(engines, {1: [SYSTEM], 2: [turn1]})
    turn2 = creq("t2", turn1 + list(range(5, 5 + 2 * BLOCK)))  # the session's next turn
    d = decide(dataclasses.replace(snap([turn2], engines), prefixes=idx), DP_ONLY)
    assert [x.engine for x in d.dispatches] == [2], (
        "the whole history is cached there (load 3 vs 0: balanced)"
    )
    off = dataclasses.replace(DP_ONLY, dispatch="least-loaded")
    assert [
        x.engine for x in decide(dataclasses.replace(snap([turn2], engines), prefixes=idx), off).dispatches
    ] == [0]
    new = creq("new", SYSTEM + list(range(7, 7 + BLOCK)))  # another session on the same system prompt
    d = decide(dataclasses.replace(snap([new], engines), prefixes=idx), DP_ONLY)
    assert [x.engine for x in d.dispatches] == [1], (
        "engines 1 and 2 hold all 8 shared blocks: the less loaded"
    )


def test_a_match_below_cache_threshold_or_no_chain_goes_to_the_least_loaded(monkeypatch):
    engines = [eng(0), eng(1, inflight=2)]
    idx = index_with(engines, {1: [SYSTEM[: 2 * BLOCK]]})
    r = creq("r", SYSTEM + list(range(2 * BLOCK)))  # 2 of 10 blocks held on engine 1: 0.2 < 0.3
    d = decide(dataclasses.replace(snap([r], engines), prefixes=idx), DP_ONLY)
    assert [(x.engine, x.rule) for x in d.dispatches] == [(0, "no-match")]
    monkeypatch.setattr("router.dp_dispatch.CACHE_THRESHOLD", 0.2)
    assert [
        x.engine for x in decide(dataclasses.replace(snap([r], engines), prefixes=idx), DP_ONLY).dispatches
    ] == [1]
    short = req("short", prompt=10)  # shorter than a block: no chain
    d = decide(dataclasses.replace(snap([short], engines), prefixes=idx), DP_ONLY)
    assert [(x.engine, x.rule) for x in d.dispatches] == [(0, "no-chain")]


def test_cache_aware_falls_back_to_least_loaded_only_when_both_balance_thresholds_are_exceeded():
    idx_for = lambda engines: index_with(engines, {1: [SYSTEM]})  # noqa: E731
    r = creq("r", SYSTEM + list(range(BLOCK)))

    def where(load0: int, load1: int) -> int:
        engines = [eng(0, inflight=load0), eng(1, inflight=load1)]
        lim = Limits(max_inflight_per_worker=100)
        (x,) = decide(
            dataclasses.replace(snap([r], engines), prefixes=idx_for(engines)), DP_ONLY, lim
        ).dispatches
        return x.engine, x.rule

    assert where(0, 8) == (1, "prefix"), "8 apart: not more than the absolute threshold"
    assert where(0, 9) == (0, "imbalanced"), "9 apart and 9 > 1.5 x 0: out of balance"
    assert where(20, 29) == (1, "prefix"), "9 apart but 29 < 1.5 x 20: balanced"
    assert where(20, 31) == (0, "imbalanced"), "11 apart and 31 > 30"


def test_requests_of_one_round_follow_each_others_prefixes():
    """The index learns a round's dispatches only after it; within the round the policy counts what it sent."""
    engines = [eng(0), eng(1)]
    a = creq("a", SYSTEM + [1] * BLOCK)
    b = creq("b", SYSTEM + [2] * BLOCK)
    d = decide(snap([a, b], engines), DP_ONLY)
    assert [x.engine for x in d.dispatches] == [0, 0], "b shares a's 8 of 9 blocks: it follows a"
    off = dataclasses.replace(DP_ONLY, dispatch="least-loaded")
    assert [x.engine for x in decide(snap([a, b], engines), off).dispatches] == [0, 1]


def test_tp_dispatches_ignore_prefixes_and_grouped_engines_are_no_candidates():
    g = bound(5, (0, 1), reason="load")
    engines = [in_epoch(0, 5), in_epoch(1, 5), eng(2, inflight=3), eng(3, inflight=3)]
    idx = index_with([eng(i) for i in range(4)], {0: [SYSTEM]})
    idx.sync(engines)  # engines 0 and 1 joined a group (their trees outlive it)
    r = creq("r", SYSTEM + [1] * BLOCK)
    d = decide(dataclasses.replace(snap([r], engines, [g], state=LIGHT), prefixes=idx), CFG)
    assert [(x.engine, x.epoch, x.rule) for x in d.dispatches] == [(0, 5, None)], "light: the load group"
    d = decide(dataclasses.replace(snap([r], engines, [g]), prefixes=idx), DP_ONLY, DP8)
    assert [(x.engine, x.rule) for x in d.dispatches] == [(2, "no-match")], "a bound engine takes no DP work"


def test_fast_targets_of_cache_aware_dp_dispatch_carry_affinity():
    (t, *_) = decide(snap([], [eng(0), eng(1)]), DP_ONLY).fast
    assert t.affinity, "a request with a prefix chain waits for a round, which places it by prefix"
    off = dataclasses.replace(DP_ONLY, dispatch="least-loaded")
    assert not any(t.affinity for t in decide(snap([], [eng(0), eng(1)]), off).fast)
    g = bound(5, (0, 1), reason="load")
    engines = [in_epoch(0, 5, n=2), in_epoch(1, 5, n=2)]  # (no idle block left to bind)
    (t,) = decide(snap([], engines, [g], state=LIGHT), CFG).fast
    assert t.epoch == 5 and not t.affinity, "a group's requests bypass the prefix cache: no affinity"


def test_light_load_widens_a_narrow_group_once_its_block_can_bind_at_full_width():
    """A priority group narrower than its node's planned width whose block is otherwise free DP
    engines with little work is released by scatter, so the block binds at full width (faster SP steps); not
    while busy, not while the block's work exceeds what the wide group takes, not without KV transformation."""
    wide = unit_policy(max_width=4)
    g = bound(4, (2, 3), last_used=100.0)
    loads = {4: GroupLoad(1, 20)}
    engines = [
        eng(0, **KVT),
        eng(1, inflight=2, **KVT),
        in_epoch(2, 4, inflight=1, **KVT),
        in_epoch(3, 4, **KVT),
    ]
    d = decide(snap(engines=engines, groups=[g], loads=loads, state=planned(4)), wide)
    assert d.commands == [((2, 3), Release(epoch=4, scatter=True))]
    assert any("widening: its block binds at width 4" in str(e) for e in d.events)
    assert not decide(snap(engines=engines, groups=[g], loads=loads, state=BUSY), wide).commands
    assert not decide(snap(engines=engines, groups=[g], loads=loads, state=LIGHT), CFG).commands, "width 2"
    heavy = [eng(0, inflight=20, **KVT), *engines[1:]]  # more than 4 engines x tp_inflight_per_engine 4
    assert not decide(snap(engines=heavy, groups=[g], loads=loads, state=planned(4)), wide).commands
    plain = [eng(0), *engines[1:]]
    assert not decide(snap(engines=plain, groups=[g], loads=loads, state=planned(4)), wide).commands


# --- nodes: one bind domain each, one global queue ---------------------------------------------------------------


def node_eng(i: int, node: str, first: int, n: int = 4, **kw) -> EngineView:
    return eng(i, n=n, node=node, pool_first=first, **kw)


def two_nodes(n: int = 4, **kw) -> list[EngineView]:
    """Node a: engines 0..n-1, node b: n..2n-1, each its own pool."""
    return [node_eng(i, "a", 0, n, **kw) for i in range(n)] + [
        node_eng(i, "b", n, n, **kw) for i in range(n, 2 * n)
    ]


def node_of(i: int, n: int = 4) -> str:
    return "a" if i < n else "b"


def test_light_load_binds_groups_inside_each_node_and_none_across():
    d = decide(snap(engines=two_nodes(), state=planned(2, nodes=("a", "b"))), CFG)
    assert d.binds, "light load binds load groups"
    assert {len({node_of(m) for m in g.members}) for g in d.binds} == {1}
    assert {node_of(g.members[0]) for g in d.binds} == {"a", "b"}, "every node binds its own"


def test_a_group_never_spans_two_small_nodes_even_where_their_engines_are_contiguous():
    """Nodes of two engines: a request that needs four engines' KV has no group to go to (no four-engine
    pool), so nothing binds; one that needs two binds inside a node."""
    es = two_nodes(2)
    binds = decide(
        snap([req("long4", prompt=3000)], engines=es, state=planned(2, nodes=("a", "b"))), CFG
    ).binds
    assert all(g.reason == "load" and g.members in ((0, 1), (2, 3)) for g in binds)
    d = decide(snap([req("long2", prompt=1500)], engines=es, state=planned(2, nodes=("a", "b"))), CFG)
    assert [g.members for g in d.binds] in ([(0, 1)], [(2, 3)])


def test_an_engine_whose_heartbeat_names_another_pool_is_not_bound_with_this_one():
    """Engine 3 claims node b's pool though its index is in node a's run: the idle (2, 3) set is not a group, so
    the high-priority request binds the busier (0, 1)."""
    es = [node_eng(i, "a", 0, inflight=3) for i in range(2)] + [node_eng(2, "a", 0), node_eng(3, "b", 0)]
    light = RouterState(busy=False, widths={"a": 1, "b": 1}, planned_at=100.0)
    d = decide(snap([req("p", priority="high")], engines=es, state=light), CFG)
    assert [g.members for g in d.binds] == [(0, 1)]


def test_dp_requests_go_to_the_least_loaded_engine_of_any_node():
    es = [node_eng(i, "a", 0, inflight=5) for i in range(4)] + [
        node_eng(i, "b", 4, inflight=5) for i in range(4, 8)
    ]
    es[6] = node_eng(6, "b", 4, inflight=0)
    d = decide(snap([req("x")], engines=es), DP_ONLY)
    assert [x.engine for x in d.dispatches] == [6]


def test_priority_order_holds_across_nodes():
    """One free slot in the whole cluster, on node b: the high-priority request takes it, whatever its node."""
    cfg, lim = DP_ONLY, Limits(max_inflight_per_worker=2)
    es = [node_eng(i, "a", 0, inflight=2) for i in range(4)] + [
        node_eng(i, "b", 4, inflight=2) for i in range(4, 8)
    ]
    es[5] = node_eng(5, "b", 4, inflight=1)
    d = decide(snap([req("hi", priority="high"), req("n1"), req("n2")], engines=es), cfg, lim)
    assert [(x.request.id, x.engine) for x in d.dispatches] == [("hi", 5)]


def test_a_whole_node_lost_releases_then_forgets_its_groups_and_its_queue_goes_to_the_other_node():
    """Node b (engines 4..7, in groups 7 and 8) stops at once: its groups are released, their records dropped the
    next round (no member beats any more), and the queue is served by node a in DP."""
    groups = [bound(7, (4, 5)), bound(8, (6, 7))]
    node_a = [node_eng(i, "a", 0) for i in range(4)]
    waiting = [req("r1"), req("r2"), req("r3")]
    d = decide(snap(waiting, engines=node_a, groups=groups), DP_ONLY)
    assert {e: g.state for e, g in d.put.items()} == {7: "releasing", 8: "releasing"}
    assert {x.engine for x in d.dispatches} <= {0, 1, 2, 3} and len(d.dispatches) == 3
    d2 = decide(snap(engines=node_a, groups=list(d.put.values()), now=100.5), DP_ONLY)
    assert sorted(d2.drop) == [7, 8], "the lost node's groups are forgotten"


def test_a_node_that_comes_back_rejoins_in_dp_and_binds_again_inside_itself():
    back = two_nodes()  # node b's engines beat again: DP, no epoch, new launches
    d = decide(snap([req(f"r{i}") for i in range(8)], engines=back), DP_ONLY)
    assert {x.engine for x in d.dispatches} >= {4, 5, 6, 7}, "its engines take DP work at once"
    d = decide(snap([req("p", priority="high")], engines=back, state=planned(2, nodes=("a", "b"))), CFG)
    assert d.binds and all(len({node_of(m) for m in g.members}) == 1 for g in d.binds)


def test_a_node_without_load_groups_binds_its_own_beside_another_nodes():
    """Node b's engines came up first and bound their load group; node a's, live later in the same light period,
    still bind theirs (one node's choice does not hold the other's engines in DP)."""
    es = two_nodes(2)
    es = [*es[:2], *(dataclasses.replace(e, mode="tp", epoch=5) for e in es[2:])]
    d = decide(
        snap(engines=es, groups=[bound(5, (2, 3), reason="load")], state=planned(2, nodes=("a", "b"))), CFG
    )
    assert [g.members for g in d.binds] == [(0, 1)]
    d = decide(
        snap(engines=es[:2] + [node_eng(i, "b", 2, 2) for i in (2, 3)], state=planned(2, nodes=("a", "b"))),
        CFG,
    )
    assert sorted(g.members for g in d.binds) == [(0, 1), (2, 3)]


def test_a_request_that_failed_on_an_engine_goes_to_another_node_while_its_node_may_be_gone():
    """It failed on engine 2 before the heartbeats of node b (2, 3) expired: the whole node may be lost, so it
    goes to node a, even though engine 3 is the least loaded; on one node it avoids engine 2 only."""
    failed = msgspec.structs.replace(req("f"), failed_on=2, attempts=1)
    es = [node_eng(i, "a", 0, 2, inflight=2) for i in (0, 1)] + [node_eng(i, "b", 2, 2) for i in (2, 3)]
    assert [x.engine for x in decide(snap([failed], engines=es), DP_ONLY).dispatches] in ([0], [1])
    one = [eng(i, inflight=2) for i in (0, 1)] + [eng(2), eng(3)]
    assert [x.engine for x in decide(snap([failed], engines=one), DP_ONLY).dispatches] == [3]
    alone = [node_eng(i, "b", 2, 2) for i in (2, 3)]  # only node b is live: its other engine
    assert [x.engine for x in decide(snap([failed], engines=alone), DP_ONLY).dispatches] == [3]


def test_fast_targets_under_light_load_cover_every_nodes_load_group():
    """Two nodes, each with its idle load group: a request arriving before the next round may go to either
    (the admission script picks the least loaded target), not only to the one group the round would pick."""
    es = [node_eng(i, "a", 0, 2, mode="tp", epoch=5, **KVT) for i in (0, 1)]
    es += [node_eng(i, "b", 2, 2, mode="tp", epoch=6, **KVT) for i in (2, 3)]
    groups = [bound(5, (0, 1), reason="load"), bound(6, (2, 3), reason="load")]
    d = decide(snap(engines=es, groups=groups, state=planned(2, nodes=("a", "b"))), CFG)
    assert sorted({(t.engine, t.epoch) for t in d.fast}) == [(0, 5), (1, 5), (2, 6), (3, 6)]
