"""router.parking: a group serving a request no engine holds alone is parked for a burst (its record kept, its
members back in DP) and resumed on the same members when calm; a lost member ends its parked requests."""

from __future__ import annotations

from flying.messages import Group, QueuedRequest, Release
from router.decision import ReleaseCause, ReleaseMode, plan
from router.engine_view import EngineView
from router.long_wait import resume_parked as resume
from router.policy import decide
from router.round import Round
from router.snapshot import GroupLoad, Snapshot
from tests.policy_settings import BUSY, LIGHT, UNIT_LIMITS, off, unit_policy

CFG = unit_policy(long_wait_s=30.0)

LONG = GroupLoad(1, 1500, 1500)  # one request of 1,500 tokens: more than one engine's 1,000


def eng(
    i: int, inflight: int = 0, epoch: int = 0, park: bool = True, parked: tuple[int, ...] = ()
) -> EngineView:
    return EngineView(i, f"e{i}", inflight, 1000, 1000, mode="tp" if epoch else "dp", epoch=epoch, num_engines=4,
                      beat_ts=100.0, kv_transform=True, park=park, parked=parked)  # fmt: skip


def snap(engines, groups=(), now=100.0, state=LIGHT, loads=None) -> Snapshot:
    return Snapshot(limits=UNIT_LIMITS, now=now, waiting=[], queued=0, engines=engines, groups=list(groups), state=state,
                    tp_load=loads or {})  # fmt: skip


def bound(epoch: int = 3, members=(0, 1), reason="long", since: float = 50.0, **kw) -> Group:
    return Group(epoch=epoch, members=members, reason=reason, state="bound", since=since, **kw)  # type: ignore[arg-type]


def surge(*engines: EngineView) -> Snapshot:
    """A burst by the demand measure: 21 requests on 4 engines, above the groups' capacity (16)."""
    return snap(list(engines), [bound()], state=BUSY, loads={3: LONG})


def test_a_long_group_is_parked_when_a_burst_comes_where_every_member_parks():
    d = decide(surge(eng(0, 1, 3), eng(1, 0, 3), eng(2, 10), eng(3, 10)), CFG)
    assert [(n.epoch, n.mode, n.cause) for n in d.releases] == [(3, ReleaseMode.PARK, ReleaseCause.LOAD_ROSE)]
    assert d.commands == [((0, 1), Release(epoch=3, park=True))]
    assert d.put[3].state == "releasing" and d.put[3].park
    assert "parking what no owner holds" in str(d.releases[0])


def test_it_keeps_serving_where_a_member_cannot_park_or_it_holds_a_high_priority_request_or_only_a_queue_builds():
    assert not decide(surge(eng(0, 1, 3), eng(1, 0, 3, park=False), eng(2, 10), eng(3, 10)), CFG).releases
    held = snap([eng(0, 1, 3), eng(1, 0, 3), eng(2, 10), eng(3, 10)], [bound(hold=True)], state=BUSY,
                loads={3: LONG})  # fmt: skip
    assert not decide(held, CFG).releases
    assert not decide(surge(eng(0, 1, 3), eng(1, 0, 3), eng(2, 10), eng(3, 10)), off("park")).releases


def test_a_parked_release_keeps_its_record_while_the_members_report_the_requests_parked():
    releasing = Group(epoch=3, members=(0, 1), reason="long", state="releasing", since=99.0, park=True)
    d = decide(snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [releasing], state=BUSY), CFG)
    assert d.put[3].state == "parked" and 3 not in d.drop
    nothing = decide(snap([eng(0), eng(1), eng(2), eng(3)], [releasing], state=BUSY), CFG)
    assert nothing.drop == [3]  # nothing was left to park


def test_parked_members_serve_dp_but_bind_no_other_group():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    s = snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [parked], state=BUSY)
    rnd = Round(s, CFG)
    assert rnd.in_groups() == frozenset() and rnd.parked_members() == {0, 1}
    assert rnd.free_sets(2) == [(2, 3)]


def test_calm_resumes_the_parked_group_on_the_same_members_in_the_same_order():
    parked = Group(
        epoch=3, members=(1, 0), reason="long", state="parked", since=99.0, park=True, carries=(2,)
    )
    d = decide(
        snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [parked], loads={3: LONG}), CFG
    )
    assert [(g.members, g.reason, g.carries, g.resumes) for g in d.binds][0] == ((1, 0), "long", (2, 3), 3)
    assert d.drop == [3]
    p = plan(d, [7, 8])
    assert [(ms, c.resume) for ms, c in p.sends][0] == ((1, 0), 3)
    assert "resumes epoch 3's parked requests" in str(d.events[0])


def test_no_resume_while_load_is_busy_or_another_long_request_runs():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    busy = snap(
        [eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [parked], state=BUSY, loads={3: LONG}
    )
    assert not decide(busy, CFG).binds
    other = bound(epoch=4, members=(2, 3))
    running = snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2, 0, 4), eng(3, 0, 4)], [parked, other],
                   loads={3: LONG, 4: LONG})  # fmt: skip
    assert not decide(running, CFG).binds


def test_a_parked_group_that_lost_a_member_ends_its_requests_on_the_others():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    d = decide(snap([eng(0, parked=(3,)), eng(2), eng(3)], [parked], state=BUSY), CFG)
    assert d.drop == [3]
    assert d.commands == [((0,), Release(epoch=3))]
    assert [(n.cause, n.engines) for n in d.releases] == [(ReleaseCause.PARKED_LOST, (1,))]
    restarted = snap([eng(0, parked=(3,)), eng(1), eng(2), eng(3)], [parked], state=BUSY)  # 1 forgot it
    assert decide(restarted, CFG).commands == [((0,), Release(epoch=3))]


def test_engines_holding_parked_requests_no_record_knows_are_told_to_end_them():
    d = decide(snap([eng(0, parked=(9,)), eng(1, parked=(9,)), eng(2), eng(3)], [], state=BUSY), CFG)
    assert d.commands == [((0, 1), Release(epoch=9))]
    carried = Group(epoch=10, members=(0, 1), reason="long", state="binding", since=99.0, carries=(9,))
    d = decide(snap([eng(0, parked=(9,)), eng(1, parked=(9,)), eng(2), eng(3)], [carried], state=BUSY), CFG)
    assert not d.commands  # a resume on its way


def test_a_long_group_whose_bind_paused_dp_work_is_parked_after_max_defer_s_instead_of_waiting():
    g = bound(since=90.0)
    s = snap([eng(0, 2, 3), eng(1, 1, 3), eng(2), eng(3)], [g], state=BUSY, loads={3: LONG})
    d = decide(s, unit_policy(long_wait_s=30.0))
    assert [(n.mode, n.cause) for n in d.releases] == [(ReleaseMode.PARK, ReleaseCause.DP_DEFERRED)]


def test_a_resume_rolled_back_before_it_bound_leaves_its_requests_parked():
    resuming = Group(epoch=8, members=(0, 1), reason="long", state="releasing", since=99.0, carries=(3,))
    d = decide(snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [resuming], state=BUSY), CFG)
    assert d.drop == [8] and d.put[3].state == "parked" and d.put[3].members == (0, 1)
    assert not d.commands  # nothing ended


def test_a_member_whose_breaker_is_open_still_holds_its_parked_kv():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[], queued=0, engines=[eng(0, parked=(3,)), eng(2), eng(3)], groups=[parked],
                 state=BUSY, held={0: (3,), 1: (3,), 2: (), 3: ()})  # (engine 1 out of the dispatchable view)  # fmt: skip
    d = decide(s, CFG)
    assert not d.commands and not d.drop


def test_a_group_parked_for_long_wait_s_resumes_whatever_the_load_and_is_never_parked_again():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=60.0, park=True)
    s = snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2, 10), eng(3, 10)], [parked], state=BUSY)
    d = decide(s, CFG)  # parked 40 s, long_wait_s 30
    assert [(g.members, g.carries, g.hold) for g in d.binds][:1] == [((0, 1), (3,), True)]


def test_no_park_where_a_member_does_not_transform_kv():
    engines = [eng(0, 1, 3), eng(1, 0, 3), eng(2, 10), eng(3, 10)]
    engines[1] = EngineView(
        1, "e1", 0, 1000, 1000, mode="tp", epoch=3, num_engines=4, beat_ts=100.0, park=True
    )
    assert not decide(surge(*engines), CFG).releases


def waiting(i: int, prompt: int, at: float, priority: str = "normal") -> QueuedRequest:
    return QueuedRequest(id=f"r{i}", priority=priority, model="m", prompt_tokens=prompt, max_tokens=10,  # type: ignore[arg-type]
                         gateway="g", enqueued_at=at)  # fmt: skip


def parked_on(*members: int, free: int = 1000) -> tuple[list[EngineView], Group]:
    """Two engines, both holding epoch 3's parked request (``free`` KV left on each), under a burst."""
    g = Group(epoch=3, members=members, reason="long", state="parked", since=99.0, park=True)
    engines = [
        EngineView(
            i,
            f"e{i}",
            0,
            free,
            1000,
            num_engines=2,
            beat_ts=100.0,
            kv_transform=True,
            park=True,
            parked=(3,) if i in members else (),
        )  # fmt: skip
        for i in range(2)
    ]
    return engines, g


def test_a_request_only_the_parked_engines_could_serve_resumes_their_group_at_once_and_for_good():
    engines, g = parked_on(0, 1, free=300)
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[waiting(1, 700, 90.0)], queued=1, engines=engines, groups=[g], state=BUSY,
                 tp_load={3: LONG})  # fmt: skip
    d = decide(s, CFG)  # a burst, parked 1 s: without the request it would stay parked
    assert not d.dispatches  # 710 tokens: more than either engine's free KV (the parked slices hold the rest)
    assert [(b.members, b.carries, b.hold) for b in d.binds] == [((0, 1), (3,), True)]
    fresh = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[waiting(1, 700, 99.9)], queued=1, engines=engines, groups=[g],
                     state=BUSY, tp_load={3: LONG})  # fmt: skip
    assert not decide(fresh, CFG).binds  # it has not waited max_defer_s yet
    roomy, g = parked_on(0, 1, free=900)
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[waiting(1, 700, 90.0)], queued=1, engines=roomy, groups=[g], state=BUSY,
                 tp_load={3: LONG})  # fmt: skip
    d = decide(s, CFG)
    assert not d.binds and [x.engine for x in d.dispatches] == [
        0
    ]  # a parked engine with the free KV serves it
    small = GroupLoad(1, 200, 1500)  # (a smaller parked share: 100 tokens a member)
    engines, g = parked_on(0, 1, free=300)  # the burst's DP work holds the rest: it waits for free KV
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[waiting(1, 700, 90.0)], queued=1, engines=engines, groups=[g], state=BUSY,
                 tp_load={3: small})  # fmt: skip
    assert not decide(s, CFG).binds


def test_a_high_priority_long_request_resumes_a_parked_group_a_normal_one_waits_for_calm():
    engines, g = parked_on(0, 1, free=300)
    long = waiting(1, 1500, 60.0)  # needs a group of two: only the parked engines make one
    s = Snapshot(
        limits=UNIT_LIMITS,
        now=100.0,
        waiting=[long],
        queued=1,
        engines=engines,
        groups=[g],
        state=BUSY,
        tp_load={3: LONG},
    )
    assert not decide(s, CFG).binds  # a normal-priority long request waits for calm (long_wait_s 30)
    high = waiting(1, 1500, 90.0, "high")
    s = Snapshot(
        limits=UNIT_LIMITS,
        now=100.0,
        waiting=[high],
        queued=1,
        engines=engines,
        groups=[g],
        state=BUSY,
        tp_load={3: LONG},
    )
    assert [b.carries for b in decide(s, CFG).binds] == [(3,)]


def test_a_distrusted_member_is_not_asked_to_resume():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    s = snap([eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)], [parked], loads={3: LONG})
    rnd = Round(s, CFG)
    rnd.suspect[1] = 200.0
    resume(rnd)
    assert not rnd.out.binds


def test_a_parked_epoch_whose_requests_all_ended_is_released_once_they_were_counted():
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True)
    engines = [eng(0, parked=(3,)), eng(1, parked=(3,)), eng(2), eng(3)]
    d = decide(snap(engines, [parked], state=BUSY, loads={3: LONG}), CFG)
    assert d.put[3].parked_requests == 1 and not d.commands  # counted: its client still waits
    counted = Group(
        epoch=3, members=(0, 1), reason="long", state="parked", since=99.0, park=True, parked_requests=1
    )
    d = decide(snap(engines, [counted], state=BUSY, loads={3: GroupLoad()}), CFG)
    assert d.drop == [3] and d.commands == [((0, 1), Release(epoch=3))]  # its client left: the KV is freed
    assert [n.cause for n in d.releases] == [ReleaseCause.PARKED_LEFT]
    assert "its parked requests ended" in str(d.releases[0])
    d = decide(snap(engines, [parked], state=BUSY, loads={3: GroupLoad()}), CFG)
    assert not d.commands and 3 not in d.drop  # never counted (sent to an engine directly): it stays


def test_a_blocked_request_resumes_one_parked_group_at_a_time():
    """Eight engines, all parked in two groups of four; a high-priority long request waits: the older group
    resumes (then it has room for the request beside its parked one), the other stays parked through the burst,
    and no second group resumes while the first binds."""
    engines = [
        EngineView(
            i,
            f"e{i}",
            0,
            300,
            1000,
            num_engines=8,
            beat_ts=100.0,
            kv_transform=True,
            park=True,
            parked=(3,) if i < 4 else (4,),
        )  # fmt: skip
        for i in range(8)
    ]
    old = Group(epoch=3, members=(0, 1, 2, 3), reason="long", state="parked", since=99.0, park=True)
    new = Group(epoch=4, members=(4, 5, 6, 7), reason="long", state="parked", since=99.0, park=True)
    high = waiting(1, 1500, 90.0, "high")
    loads = {3: LONG, 4: LONG}
    s = Snapshot(
        limits=UNIT_LIMITS,
        now=100.0,
        waiting=[high],
        queued=1,
        engines=engines,
        groups=[old, new],
        state=BUSY,
        tp_load=loads,
    )
    d = decide(s, CFG)
    assert [(b.members, b.carries, b.hold) for b in d.binds] == [((0, 1, 2, 3), (3,), True)]
    wide = waiting(2, 4500, 90.0, "high")  # wider than the binding group's pooled KV: only all eight hold it
    binding = Group(epoch=9, members=(0, 1, 2, 3), reason="long", state="binding", since=99.9, carries=(3,))
    s = Snapshot(limits=UNIT_LIMITS, now=100.0, waiting=[wide], queued=1, engines=engines, groups=[binding, new], state=BUSY,
                 tp_load={4: LONG})  # fmt: skip
    assert not decide(s, CFG).binds  # not the second parked group while the first binds
