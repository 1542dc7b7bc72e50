"""A round's decision as values: the typed notes and the log lines made from them, and the plan both appliers
(the router's dispatcher and the simulator) follow."""

from __future__ import annotations

import pytest

from flying.messages import Bind, Group, QueuedRequest, Release, RouterState
from router.decision import (
    BindMode,
    BindNote,
    Decision,
    Dispatch,
    DistrustNote,
    PlanNote,
    ReleaseCause,
    ReleaseMode,
    ReleaseNote,
    plan,
)
from router.planner import Choice, Demand, Forecast

REQ = QueuedRequest(id="a", priority="normal", model="m", prompt_tokens=1, max_tokens=1, gateway="g", enqueued_at=0.0)  # fmt: skip


F1 = Forecast(1, 130.0, 130.0, 30.0, 100.0, 0.0, 0.13)
F8 = Forecast(8, 40.0, 40.0, 20.0, 100.0, 0.0, 0.04)


@pytest.mark.parametrize(
    ("note", "text"),
    [
        (ReleaseNote(7, (2, 3), "priority", ReleaseMode.RETRACT, ReleaseCause.DP_DEFERRED, seconds=5.0),
         "release epoch 7 (2, 3) (priority) retracting: DP work deferred for 5 s"),
        (ReleaseNote(3, (0, 1), "load", ReleaseMode.WAIT, ReleaseCause.NOT_BOUND, seconds=60.0),
         "release epoch 3 (0, 1) (load): not bound within 60 s: rolled back"),
        (ReleaseNote(3, (0, 1), "load", ReleaseMode.WAIT, ReleaseCause.NOT_ACKNOWLEDGED, 2.0, engines=(1,)),
         "release epoch 3 (0, 1) (load): [1] did not acknowledge within 2 s: rolled back"),
        (ReleaseNote(4, (0, 1), "load", ReleaseMode.SCATTER, ReleaseCause.LOAD_ROSE),
         "release epoch 4 (0, 1) (load) by scatter: load rose"),
        (ReleaseNote(4, (0, 1), "long", ReleaseMode.WAIT, ReleaseCause.NO_TP_WORK, seconds=1.0),
         "release epoch 4 (0, 1) (long): no TP work for 1 s"),
        (ReleaseNote(4, (0, 1), "load", ReleaseMode.WAIT, ReleaseCause.MAKING_ROOM, width=4),
         "release epoch 4 (0, 1) (load): making room for a width-4 group"),
        (ReleaseNote(4, (0, 1), "load", ReleaseMode.WAIT, ReleaseCause.MEMBER_GONE),
         "release epoch 4 (0, 1) (load): a member is gone"),
        (BindNote((0, 1), "load", BindMode.ADOPT, 12.4), "bind (0, 1) (load, adoption, 12 ms; width 2: SP steps from the workers' threshold, TP below)"),
        (BindNote((2, 3), "priority", BindMode.HARD, engines=8), "bind (2, 3) (priority, hard preemption; width 2 of 8 engines: SP steps from the workers' threshold, TP below)"),
        (BindNote((0, 1, 2, 3), "load", BindMode.HARD, sp_threshold=1024, engines=4), "bind (0, 1, 2, 3) (load, hard preemption; width 4 of 4 engines: SP steps from 1024 tokens, TP below)"),
        (BindNote((0, 1), "long", BindMode.SEQUENTIAL, sp_threshold=0), "bind (0, 1) (long, sequential preemption; width 2: TP steps)"),
        (PlanNote("0", 1, Choice(F8, F1, F1), Demand(8, 1.25, 1000, 100)), "node 0: load groups of width 8 (width 8: TTFT 40 ms, TPOT 20 ms predicted; DP: TTFT 130 ms, TPOT 30 ms predicted; 1.2 req/s of 1000/100 tokens, 0 queued)"),
        (PlanNote("a", 8, Choice(F1, F8, F8), Demand(8, 30, 1000, 100, 5000)), "node a: back to DP (DP: TTFT 130 ms, TPOT 30 ms predicted; width 8: TTFT 40 ms, TPOT 20 ms predicted; 30.0 req/s of 1000/100 tokens, 5000 queued)"),
        (DistrustNote((1, 2), 10.0), "engines [1, 2] not picked for binds for 10 s"),
    ],
)  # fmt: skip
def test_log_lines_are_made_from_the_typed_notes(note, text):
    assert str(note) == text


def test_modes_are_the_metrics_label_values():
    g = Group(epoch=1, members=(0, 1), reason="load", preempt="sequential")
    assert BindMode.of(g) == "sequential" and BindMode.of(Group(epoch=1, members=(0, 1), reason="load", adopt=True)) == "adopt"  # fmt: skip
    assert [ReleaseMode.of(c) for c in (None, Release(epoch=1), Release(epoch=1, retract=True), Release(epoch=1, scatter=True))] == ["wait", "wait", "retract", "scatter"]  # fmt: skip
    assert ReleaseMode.SCATTER.command(5) == Release(epoch=5, scatter=True)


def test_a_release_sends_its_command_and_keeps_its_note_in_order():
    d = Decision()
    first = ReleaseNote(4, (0, 1), "load", ReleaseMode.RETRACT, ReleaseCause.LOAD_ROSE)
    d.events.append(BindNote((2, 3), "priority", BindMode.HARD))
    d.release(first)
    assert d.commands == [((0, 1), Release(epoch=4, retract=True))]
    assert d.releases == [first] and d.notes[1] == str(first)


def test_the_plan_numbers_binds_and_orders_records_then_commands_then_dispatches():
    changed = Group(epoch=4, members=(0, 1), reason="load", state="releasing")
    new = Group(epoch=0, members=(2, 3), reason="priority", adopt=True)
    d = Decision(
        binds=[new],
        put={4: changed},
        drop=[2],
        commands=[((0, 1), Release(epoch=4))],
        dispatches=[Dispatch(REQ, 0, "u"), Dispatch(REQ, 2, "u", epoch=9)],
        state=RouterState(busy=False),
    )
    p = plan(d, [9])
    assert [g.epoch for g in p.records] == [4, 9] and p.binds[0].epoch == 9 and p.drop == [2]
    assert p.sends == [((0, 1), Release(epoch=4)), ((2, 3), Bind(epoch=9, members=(2, 3), adopt=True))]
    assert [x.engine for x in p.dp_dispatches] == [0] and p.state == RouterState(busy=False)
    with pytest.raises(ValueError, match="1 binds need as many epochs"):
        plan(d, [])


def test_every_bind_carries_the_routers_sp_threshold():
    new = Group(epoch=0, members=(0, 1, 2, 3), reason="load")
    p = plan(Decision(binds=[new], sp_threshold=1024), [5])
    assert p.sends == [((0, 1, 2, 3), Bind(epoch=5, members=(0, 1, 2, 3), sp_threshold=1024))]
    unset = plan(Decision(binds=[new]), [6]).sends[0][1]
    assert isinstance(unset, Bind) and unset.sp_threshold is None  # each worker's own --sp-threshold


def test_the_decision_log_has_an_entry_per_event_each_bind_with_its_epoch():
    """The router's decision log (flying:router:decisions): the events in order, as values and as the log line."""
    regime = PlanNote("0", 1, Choice(F8, F1, F1), Demand(4, 0.2, 512, 128))
    release = ReleaseNote(4, (0, 1), "load", ReleaseMode.SCATTER, ReleaseCause.LOAD_ROSE)
    binds = [BindNote((0, 1), "load", BindMode.HARD), BindNote((2, 3), "priority", BindMode.HARD)]
    d = Decision(
        binds=[
            Group(epoch=0, members=(0, 1), reason="load"),
            Group(epoch=0, members=(2, 3), reason="priority"),
        ],
        events=[regime, binds[0], release, DistrustNote((3,), 10.0), binds[1]],
    )
    log = plan(d, [8, 9]).log(12.5)
    assert [(e.kind, e.epoch, e.members, e.reason, e.cause, e.busy) for e in log] == [
        ("regime", 0, (), "", "", False),
        ("bind", 8, (0, 1), "load", "", False),
        ("release", 4, (0, 1), "load", "load rose", False),
        ("distrust", 0, (3,), "", "", False),
        ("bind", 9, (2, 3), "priority", "", False),
    ]
    assert [e.text for e in log] == d.notes and {e.ts for e in log} == {12.5}
