"""router.long_wait: a long request of normal priority waits for calm, bounded by long_wait_s; then it runs on the
bound load group, else binds the width it needs; high priority never waits; the decision log says why, once."""

from __future__ import annotations

import dataclasses

import msgspec

from flying.messages import DecisionEvent, Group, QueuedRequest, RouterState
from router.decision import LongWaitNote, WaitCause, log_entry
from router.engine_view import EngineView
from router.long_wait import forget_old, unrest, waits
from router.policy import decide
from router.round import Round
from router.snapshot import GroupLoad, Snapshot
from tests.policy_settings import BUSY, LIGHT, UNIT_LIMITS, off, planned, unit_policy

# light: demand (queued + inflight) at most light_load (0.5) x 4 per engine x 4 engines = 8
CFG = unit_policy(long_wait_s=30.0)


def eng(i: int, inflight: int = 0, epoch: int = 0) -> EngineView:
    return EngineView(i, f"e{i}", inflight, 1000, 1000, mode="tp" if epoch else "dp", epoch=epoch, num_engines=4,
                      beat_ts=100.0)  # fmt: skip


def long(i: str = "L", at: float = 100.0, priority: str = "normal") -> QueuedRequest:
    return QueuedRequest(id=i, priority=priority, model="m", prompt_tokens=1500, max_tokens=10, gateway="g",  # type: ignore[arg-type]
                         enqueued_at=at)  # fmt: skip


def short(i: str) -> QueuedRequest:
    return QueuedRequest(id=i, model="m", prompt_tokens=10, max_tokens=10, gateway="g", enqueued_at=100.0)


def snap(waiting, engines=None, groups=(), now=100.0, state=LIGHT, loads=None) -> Snapshot:
    engines = [eng(i) for i in range(4)] if engines is None else engines
    return Snapshot(limits=UNIT_LIMITS, now=now, waiting=list(waiting), queued=len(waiting), engines=engines, groups=list(groups),
                    state=state, tp_load=loads or {})  # fmt: skip


BUSY_ENGINES = [eng(0, 4), eng(1, 4), eng(2, 4), eng(3, 4)]  # demand 16 + queued: not light


def replanned(state: RouterState, width: int, now: float) -> RouterState:
    """``state`` (with its noted waits) as the planner leaves it having chosen ``width`` at ``now``."""
    return msgspec.structs.replace(state, busy=width == 1, widths={"0": width}, planned_at=now)


def test_calm_is_light_load_a_small_backlog_and_no_other_long_request():
    assert unrest(Round(snap([long()]), CFG)) is None
    assert unrest(Round(snap([long()], BUSY_ENGINES, state=BUSY), CFG)) is WaitCause.BUSY
    assert unrest(Round(snap([], state=BUSY), CFG)) is None, "an idle cluster is calm whatever the plan"
    backlog = [eng(i, 5) for i in range(4)]  # 20 inflight: above the groups' capacity 16
    assert unrest(Round(snap([], backlog), CFG)) is WaitCause.BACKLOG
    g = Group(epoch=3, members=(0, 1), reason="load", state="bound")
    running = snap([long()], [eng(0, 1, epoch=3), eng(1, 0, epoch=3), eng(2), eng(3)], [g],
                   loads={3: GroupLoad(1, 1500, 1500)})  # fmt: skip
    assert unrest(Round(running, CFG)) is WaitCause.TURN  # the load group runs a long request


def test_a_normal_long_request_waits_while_load_is_not_light_and_the_log_says_why_once():
    d = decide(snap([long()], BUSY_ENGINES, state=BUSY), CFG)
    assert not d.binds and not d.dispatches
    notes = [e for e in d.events if isinstance(e, LongWaitNote)]
    assert notes == [LongWaitNote("L", 1510, WaitCause.BUSY, 30.0, 17)]
    assert str(notes[0]) == (
        "long request L (1,510 tokens) waits for calm, at most 30 s: load is not light (17 requests)"
    )
    assert d.state.long_waits == {"L": 100.0}
    again = decide(snap([long()], BUSY_ENGINES, now=105.0, state=replanned(d.state, 1, 105.0)), CFG)
    assert not again.binds and not [e for e in again.events if isinstance(e, LongWaitNote)]  # noted once


def test_calm_ends_the_wait_and_the_request_binds_the_width_it_needs():
    waiting = decide(snap([long()], BUSY_ENGINES), CFG).state
    d = decide(snap([long()], now=110.0, state=waiting), CFG)
    assert [(g.members, g.reason) for g in d.binds] == [((0, 1), "long")]  # no wider: the rest keeps (2, 3)
    note = next(e for e in d.events if isinstance(e, LongWaitNote))
    assert note.cause is WaitCause.CALM and note.waited_s == 10.0
    assert "waited 10.0 s: calm" in str(note)
    assert d.state.long_waits["L"] < 0  # ended: it does not wait again


def test_without_parking_the_bound_ends_the_wait_even_under_load_and_then_it_binds_the_width_it_needs():
    cfg = off("park", base=CFG)
    waiting = decide(snap([long()], BUSY_ENGINES), cfg).state
    d = decide(snap([long()], BUSY_ENGINES, now=130.0, state=waiting), cfg)
    assert [(g.members, g.reason) for g in d.binds] == [((0, 1), "long")]
    assert [e.cause for e in d.events if isinstance(e, LongWaitNote)] == [WaitCause.BOUND]


def test_past_the_bound_a_burst_holds_it_until_twice_the_bound_then_it_binds_and_is_never_parked():
    parking = [dataclasses.replace(e, park=True) for e in BUSY_ENGINES]
    waiting = replanned(decide(snap([long()], parking, state=BUSY), CFG).state, 1, 130.0)
    assert waiting.busy
    d = decide(snap([long()], parking, now=130.0, state=waiting), CFG)
    assert not d.binds  # bound now, it would be parked in this burst at once
    assert not [e for e in d.events if isinstance(e, LongWaitNote)]  # (still the one wait)
    assert decide(
        snap([long()], BUSY_ENGINES, now=130.0, state=waiting), CFG
    ).binds  # engines that do not park
    d = decide(snap([long()], parking, now=160.0, state=replanned(d.state, 1, 160.0)), CFG)
    assert [(g.members, g.reason, g.hold) for g in d.binds] == [((0, 1), "long", True)]
    assert [e.cause for e in d.events if isinstance(e, LongWaitNote)] == [WaitCause.BOUND]


def test_high_priority_never_waits():
    d = decide(snap([long(priority="high")], BUSY_ENGINES), CFG)
    assert [(g.members, g.reason) for g in d.binds] == [((0, 1), "long")]
    assert not [e for e in d.events if isinstance(e, LongWaitNote)]


def test_one_long_request_at_a_time_even_within_a_round():
    d = decide(snap([long("A"), long("B")]), CFG)
    assert [g.reason for g in d.binds] == ["long"]
    assert [(e.request, e.cause) for e in d.events if isinstance(e, LongWaitNote)] == [("B", WaitCause.TURN)]


def test_in_calm_a_long_request_joins_the_bound_load_group():
    g = Group(epoch=4, members=(0, 1, 2, 3), reason="load", state="bound")
    engines = [eng(i, epoch=4) for i in range(4)]
    d = decide(snap([long()], engines, [g], state=planned(4)), CFG)
    assert [(x.request.id, x.epoch) for x in d.dispatches] == [("L", 4)] and not d.binds and not d.commands


def test_a_group_running_a_long_request_serves_on_under_busy_load_instead_of_releasing():
    g = Group(epoch=4, members=(0, 1, 2, 3), reason="load", state="bound")
    engines = [eng(i, 2, epoch=4) for i in range(4)]
    loads = {4: GroupLoad(8, 3000, 1500)}
    d = decide(snap([short(f"s{i}") for i in range(20)], engines, [g], state=BUSY, loads=loads), CFG)
    assert d.state.busy and not d.commands
    assert len(d.dispatches) == 20 and {x.epoch for x in d.dispatches} == {4}  # DP has no engine: the group


def test_old_notes_are_forgotten():
    rnd = Round(snap([], now=200.0, state=RouterState(busy=False, long_waits={"a": 100.0, "b": -150.0})), CFG)
    forget_old(rnd)  # horizon: 200 - 2 x 30 = 140
    assert rnd.out.state.long_waits == {"b": -150.0}


def test_a_wait_note_is_a_wait_entry_of_the_decision_log():
    note = LongWaitNote("L", 1510, WaitCause.BACKLOG, 30.0, 40)
    entry = log_entry(note, 5.0)
    assert entry == DecisionEvent(
        ts=5.0, kind="wait", text=str(note), reason="long", cause="the engines hold a backlog"
    )
    assert msgspec.json.decode(msgspec.json.encode(entry), type=DecisionEvent) == entry
    assert not WaitCause.BACKLOG.ended and WaitCause.CALM.ended and WaitCause.BOUND.ended


def test_waits_marks_a_request_that_found_calm_at_once_as_ended():
    rnd = Round(snap([long()]), CFG)
    assert not waits(rnd, long())
    assert rnd.out.state.long_waits == {"L": -100.0} and not rnd.out.events  # nothing to say: it did not wait
