"""The worker's DP <-> TP state machine (worker_ext.binding), transition by transition, against fakes of the
scheduler surface, the pooled group and the layout (tests/fakes.py): no SGLang process."""

from __future__ import annotations

import logging

import pytest

from flying.messages import Bind, Release
from tests.fakes import FakeEngine, FakeGroup, FakeLayout, FakePool, FakeReq, FakeStore
from worker_ext import binding
from worker_ext.binding import Binding
from worker_ext.member_relay import POLL_S
from worker_ext.rank_messages import AdoptManifest, Forward, Handshake, Noop, ReleasePlan
from worker_ext.sglang_patches import LOCAL_GROUP
from worker_ext.sglang_patches.requests import Emitted


def make(index: int = 0, members: tuple[int, ...] = (0, 1), inbox: list | None = None, **engine_kw):
    engine = FakeEngine(**engine_kw)
    group = FakeGroup(members, members.index(index) if index in members else 0, inbox)
    pool = FakePool({members: group}, store=FakeStore())
    layout = FakeLayout()
    changes: list[str] = []
    b = Binding(engine, index, pool, layout, on_change=lambda: changes.append(b.status()["mode"]))
    return b, engine, group, layout, changes


@pytest.fixture(autouse=True)
def _quiet_aborts(caplog):
    caplog.set_level(logging.CRITICAL, logger="flying")


def test_a_hard_bind_waits_for_a_clean_step_boundary_then_pauses_dp_work_with_its_kv():
    running = FakeReq("dp-1", kv_len=7)
    b, engine, group, layout, _ = make(running_reqs=[running], waiting_reqs=[FakeReq("dp-2")], clean=False)
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.status()["mode"] == "dp" and b.status()["pending"] == 1
    engine.clean = True
    b.on_step([])
    st = b.status()
    assert (st["mode"], st["epoch"], st["pending"], st["group"], st["width"]) == ("tp", 1, 0, (0, 1), 2)
    assert group.sent == [Handshake(1)]
    assert engine.running_reqs == [] and engine.waiting_reqs == []  # paused, not dropped
    assert running.kv_len == 7
    assert (engine.width, layout.width, engine.bypassed, engine.idle_checks) == (2, 2, True, False)
    assert st["max_total_tokens"] == engine.limits.max_total_tokens  # its own, not the group's
    assert engine.idle_poll_s == POLL_S  # idle, the leader still reads what its members relay, at once


def test_releasing_a_drained_group_restores_the_dp_layout_and_resumes_paused_work():
    b, engine, group, layout, changes = make(running_reqs=[FakeReq("dp-1", kv_len=3)])
    b.on_step([Bind(epoch=1, members=(0, 1))])
    b.on_step([Release(epoch=1)])
    assert isinstance(group.sent[-1], ReleasePlan) and group.sent[-1].next is None
    assert b.status()["mode"] == "dp" and b.epoch is None
    assert [r.rid for r in engine.running_reqs] == ["dp-1"] and engine.running_reqs[0].kv_len == 3
    assert (engine.width, layout.width, layout.weights_width, engine.bypassed) == (1, 1, 1, False)
    assert engine.idle_checks and engine.idle_poll_s is None
    assert changes == ["tp", "dp"]


def test_a_release_waits_while_tp_requests_are_live_and_keeps_the_group_alive():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.waiting_reqs = [FakeReq("tp-1")]
    b.plans._last_sent = 0.0  # a keepalive is due
    b.on_step([Release(epoch=1)])
    assert b.epoch is not None and b.epoch.release_asked
    assert isinstance(group.sent[-1], Noop)
    engine.waiting_reqs = []
    b.on_step([])
    assert b.epoch is None and isinstance(group.sent[-1], ReleasePlan)


def test_a_release_of_a_pending_bind_cancels_it_and_lets_held_work_in():
    b, engine, _, _, changes = make(running_reqs=[FakeReq("dp-1")], waiting_reqs=[FakeReq("dp-2")])
    b.on_step([Bind(epoch=3, members=(0, 1), preempt="sequential")])
    assert engine.waiting_reqs == [] and b.pending.held == 1  # no new DP work while the running work drains
    b.on_step([Release(epoch=3)])
    assert b.status()["pending"] == 0 and b.epoch is None
    assert [r.rid for r in engine.waiting_reqs] == ["dp-2"]
    assert changes == ["dp"]
    b.on_step([Bind(epoch=3, members=(0, 1))])  # the same bind again (a follower re-reading its stream)
    assert b.status()["pending"] == 0


def test_a_sequential_bind_enters_once_every_member_has_drained():
    store = FakeStore()
    b, engine, _, _, _ = make(running_reqs=[FakeReq("dp-1")])
    b.pool.store = store
    b.on_step([Bind(epoch=2, members=(0, 1), preempt="sequential")])
    assert b.epoch is None
    engine.running_reqs[0].finished_reason = "stop"
    b.on_step([])
    assert (
        b.epoch is None and store.counters["flying/seq/2/drained"] == 1
    )  # counted itself, waits for engine 1
    store.add("flying/seq/2/drained", 1)
    b.on_step([])
    assert b.epoch is not None and b.epoch.epoch == 2


def test_a_member_lost_during_the_bind_handshake_returns_the_engine_to_dp_with_its_work():
    b, engine, group, layout, _ = make(index=1, running_reqs=[FakeReq("dp-1", kv_len=5)])
    group.broken = True
    b.on_step([Bind(epoch=1, members=(0, 1))])
    st = b.status()
    assert st["mode"] == "dp" and "epoch 1 aborted" in st["switch_error"]
    assert [r.rid for r in engine.running_reqs] == ["dp-1"] and engine.running_reqs[0].kv_len == 5
    assert (layout.width, layout.weights_width, engine.width, engine.bypassed) == (1, 1, 1, False)
    assert b.last_epoch == 1  # not entered again


def test_a_switch_error_clears_when_a_later_switch_works_or_after_error_keep_s(monkeypatch):
    b, _, _, _, _ = make()
    b.pool.store = None  # refused: no barrier without a store
    b.on_step([Bind(epoch=1, members=(0, 2), preempt="sequential")])
    assert "refused" in b.status()["switch_error"]
    b.on_step([Bind(epoch=2, members=(0, 1))])
    b.on_step([Release(epoch=2)])
    assert b.status()["mode"] == "dp" and b.status()["switch_error"] == ""
    b, _, group, _, _ = make(index=1)
    group.broken = True
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.status()["switch_error"]
    later = binding.time.monotonic() + binding.ERROR_KEEP_S + 1
    monkeypatch.setattr(binding.time, "monotonic", lambda: later)
    assert b.status()["switch_error"] == "", "a stale error leaves the heartbeat"


def test_a_wrong_handshake_aborts_the_bind():
    b, _, _, _, _ = make(index=1, inbox=[Handshake(7)])
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.epoch is None and "HandshakeMismatch" in b.error


def test_a_bind_over_a_group_the_pool_lacks_is_refused_and_held_work_comes_back():
    b, engine, _, _, _ = make(waiting_reqs=[FakeReq("dp-1")])
    b.pool.store = None  # no barrier without a store: the pool refuses the bind instead
    b.on_step([Bind(epoch=1, members=(0, 2), preempt="sequential")])
    assert b.epoch is None and "refused" in b.error
    assert [r.rid for r in engine.waiting_reqs] == ["dp-1"]


def test_an_adoption_whose_manifests_fail_leaves_the_dp_work_running_and_resets_the_group():
    """Nothing has moved when the manifests' all-gather fails: the DP requests (their KV still in the engine's
    own allocator) go on in DP, none is aborted or freed through the group's slots, and the group is reset (its
    pairs are gone: every member rebuilds it)."""
    running = FakeReq("dp-1", kv_len=4)
    b, engine, group, layout, _ = make(running_reqs=[running], waiting_reqs=[FakeReq("dp-2")])
    real = group.all_gather_object

    def gather_fails(obj):
        group.broken = True
        return real(obj)

    group.all_gather_object = gather_fails  # type: ignore[method-assign]
    b.on_step([Bind(epoch=1, members=(0, 1), adopt=True)])
    assert b.epoch is None and "aborted before it began" in b.error
    assert engine.lost == [] and running.finished_reason is None and running.kv_len == 4
    assert [r.rid for r in engine.running_reqs] == ["dp-1"] and [r.rid for r in engine.waiting_reqs] == [
        "dp-2"
    ]
    assert (engine.width, layout.width, engine.bypassed) == (1, 1, False)
    assert b.pool.resets == [((0, 1), 1)]


def test_an_adopting_follower_whose_handshake_fails_keeps_its_dp_work():
    running = FakeReq("dp-1", kv_len=6)
    b, engine, group, layout, _ = make(index=1, running_reqs=[running])
    group.broken = True
    b.on_step([Bind(epoch=3, members=(0, 1), adopt=True)])
    assert b.epoch is None and engine.lost == [] and running.finished_reason is None
    assert [r.rid for r in engine.running_reqs] == ["dp-1"] and running.kv_len == 6
    assert b.pool.resets == [((0, 1), 3)]


def test_an_epoch_aborted_after_it_began_resets_the_group():
    b, _, _, _, _ = make(index=1, inbox=[Handshake(2)])
    b.on_step([Bind(epoch=2, members=(0, 1))])  # bound, then the leader goes silent while it follows
    assert b.epoch is None and "epoch 2 aborted: " in b.error
    assert b.pool.resets == [((0, 1), 2)]


def test_an_adoption_a_member_cannot_hold_falls_back_to_a_hard_bind():
    b, engine, group, layout, _ = make(running_reqs=[FakeReq("dp-1", kv_len=4)])
    layout.available = 0
    group.others = [AdoptManifest(rank=1, available=0, running=[("x", 8, 0)])]
    b.on_step([Bind(epoch=1, members=(0, 1), adopt=True)])
    assert b.epoch is not None  # bound, hard: the DP work is paused with its KV
    assert engine.running_reqs == []
    b.on_step([Release(epoch=1)])
    assert [r.rid for r in engine.running_reqs] == ["dp-1"]


def test_an_abort_of_paused_dp_work_is_applied_once_the_release_puts_it_back():
    """SGLang looks for an aborted request in its queues and batches, not in the DP work a bind set aside: the abort
    is kept and applied again when that work is back, so it ends there instead of running for a client gone."""
    b, engine, _, _, _ = make(running_reqs=[FakeReq("dp-1~0_0", kv_len=3)], waiting_reqs=[FakeReq("dp-2~0")])
    b.on_step([Bind(epoch=1, members=(0, 1))])
    b.note_abort("dp-1~0")  # a prefix of the paused request's rid (its choice 0)
    b.note_abort("tp-9~0")  # not set aside: SGLang's own handling was all it needed
    b.on_step([])
    assert "abort dp-1~0" not in engine.calls, "bound: the paused request is out of SGLang's queues"
    b.on_step([Release(epoch=1)])
    assert b.epoch is None and [r.rid for r in engine.running_reqs] == ["dp-1~0_0"]
    b.on_step([])
    assert [c for c in engine.calls if c.startswith("abort ")] == ["abort dp-1~0"]
    b.on_step([])
    assert [c for c in engine.calls if c.startswith("abort ")] == ["abort dp-1~0"], "applied once"


def test_an_abort_of_dp_work_held_back_for_a_sequential_bind_is_applied_when_it_is_let_in():
    b, engine, _, _, _ = make(waiting_reqs=[FakeReq("w-1~0")], running_reqs=[FakeReq("r-1~0")])
    b.on_step([Bind(epoch=1, members=(0, 1), preempt="sequential")])
    assert [r.rid for r in b.pending.peek_held()] == ["w-1~0"]
    b.note_abort("w-1~0")
    b.on_step([Release(epoch=1)])  # the pending bind is rolled back: held work comes back
    b.on_step([])
    assert "abort w-1~0" in engine.calls


def test_the_heartbeat_counts_the_dp_work_a_bind_paused_until_the_release_resumes_it():
    """The router cannot see a stash: an adoption that fell back to a hard bind looks like one that adopted, unless
    the engine says how many DP requests it set aside (``paused``)."""
    b, _, group, layout, _ = make(running_reqs=[FakeReq("dp-1", kv_len=4)], waiting_reqs=[FakeReq("dp-2")])
    layout.available = 0
    group.others = [AdoptManifest(rank=1, available=0, running=[("x", 8, 0)])]
    assert b.status()["paused"] == 0
    b.on_step([Bind(epoch=1, members=(0, 1), adopt=True)])
    assert b.epoch is not None and b.status()["paused"] == 2  # neither running nor waiting: set aside
    b.on_step([Release(epoch=1)])
    assert b.status()["paused"] == 0


def test_a_request_that_cannot_move_pauses_the_members_work_and_the_rest_adopts():
    pinned = FakeReq("dp-1", kv_len=4, movable=False)
    b, engine, group, _, _ = make(running_reqs=[pinned])
    group.others = [AdoptManifest(rank=1, available=0, running=[])]
    b.on_step([Bind(epoch=1, members=(0, 1), adopt=True)])
    assert b.epoch is not None and engine.running_reqs == []
    b.on_step([Release(epoch=1)])
    assert engine.running_reqs == [pinned]


def test_a_leader_whose_group_breaks_mid_forward_finishes_the_step_alone_then_aborts_the_epoch():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-1", kv_len=2)]
    group.broken = True
    ran = []
    out = b.around_forward(lambda runner, fb: ran.append(fb) or "logits", None, {"tokens": [("tp-1", 3, 1)]})
    assert out == "logits" and len(ran) == 1
    assert engine.tp_groups[-1] is LOCAL_GROUP
    assert any(c.startswith("abort_batch") for c in engine.calls)
    assert b.epoch is not None and b.epoch.failed is not None
    b.on_step([])
    assert b.epoch is None and engine.lost == ["tp-1"]


def test_a_bound_leader_broadcasts_a_plan_before_each_forward():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-1")]
    b.around_forward(lambda runner, fb: None, None, {"tokens": [("tp-2", 5, 5)]})
    plan = group.sent[-1]
    assert isinstance(plan, Forward) and plan.live == ["tp-1", "tp-2"]
    assert engine.tp_groups == [group]


def test_unbound_forwards_run_as_they_are_and_keep_the_follower_template():
    b, engine, _, _, _ = make()
    b.around_forward(lambda runner, fb: None, None, {"tokens": []})
    assert b.plans.template == {"tokens": []} and engine.tp_groups == []


def test_a_follower_executes_plans_streams_its_own_requests_and_leaves_on_the_release():
    mine = FakeReq("own-1", output_ids=[1])
    plans = [
        Handshake(1),
        Forward({"tokens": [("tp-1", 4, 4)]}, ["tp-1"]),
        Noop([Emitted(rid="own-1", output_ids=[2, 3])]),
        Forward({"tokens": [("tp-1", 5, 1)]}, ["tp-1"]),
        ReleasePlan(),
    ]
    b, engine, _, _, _ = make(index=1, inbox=plans)
    b.plans.keep_template({"tokens": []})
    b.ownership.hold([mine])
    b.on_step([Bind(epoch=1, members=(0, 1))])  # a follower serves plans inside its step boundary
    assert b.epoch is None and b.status()["mode"] == "dp"
    assert [len(slots) for _, slots in engine.forwards] == [4, 1]
    assert engine.forwards[0][0] == engine.forwards[1][0]  # the same shadow row, grown
    assert mine.output_ids == [1, 2, 3] and engine.streamed == ["own-1"]
    assert engine.rows_in_use == set() and engine.slots_freed == 5  # the shadow freed at release


def test_a_follower_whose_leader_goes_silent_aborts_its_epoch_and_ends_its_own_requests():
    mine = FakeReq("own-1")
    b, engine, _, _, _ = make(index=1, inbox=[Handshake(1)])
    b.ownership.hold([mine])
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.epoch is None and "aborted" in b.error
    assert engine.lost == ["own-1"] and mine.finished_reason == "group lost"


def test_a_follower_out_of_kv_aborts_the_epoch_instead_of_crashing():
    b, engine, _, _, _ = make(index=1, inbox=[Handshake(1), Forward({"tokens": [("tp-1", 9, 9)]}, ["tp-1"])])
    b.plans.keep_template({"tokens": []})
    engine.kv_free = 4
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.epoch is None and "FollowerOutOfKV" in b.error


def test_a_width_change_goes_straight_to_the_new_group_with_dp_work_still_paused():
    b, engine, group, layout, _ = make(members=(0, 1), running_reqs=[FakeReq("dp-1")])
    wide = FakeGroup((0, 1, 2, 3), 0)
    b.pool.groups[(0, 1, 2, 3)] = wide
    b.on_step([Bind(epoch=1, members=(0, 1))])
    b.on_step([Bind(epoch=2, members=(0, 1, 2, 3))])
    assert isinstance(group.sent[-1], ReleasePlan) and group.sent[-1].next == Bind(
        epoch=2, members=(0, 1, 2, 3)
    )
    assert b.status()["epoch"] == 2 and layout.width == 4 and engine.width == 4
    assert engine.running_reqs == []  # still paused
    b.on_step([Release(epoch=2)])
    assert [r.rid for r in engine.running_reqs] == ["dp-1"] and engine.width == 1


def test_a_width_change_waiting_for_live_tp_requests_is_reported_pending_and_a_release_of_it_cancels_it():
    """The router rolled back a width change that waited for its group's streams; the leader applied it anyway
    once they ended, leaving the engines in a group no record knew (every request then timed out)."""
    b, engine, group, layout, _ = make(members=(0, 1))
    b.pool.groups[(0, 1, 2, 3)] = FakeGroup((0, 1, 2, 3), 0)
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-1")]  # a stream of the group: the change waits for it
    b.on_step([Bind(epoch=2, members=(0, 1, 2, 3))])
    assert (b.status()["epoch"], b.status()["pending"]) == (1, 2)
    b.on_step([Release(epoch=2)])  # rolled back
    assert (b.status()["epoch"], b.status()["pending"]) == (1, 0)
    engine.running_reqs = []
    b.on_step([])
    assert b.epoch is None and isinstance(group.sent[-1], ReleasePlan) and group.sent[-1].next is None
    assert layout.width == 1
    b.on_step([Bind(epoch=2, members=(0, 1, 2, 3))])  # read again: an epoch already rolled back
    assert b.status()["pending"] == 0
    b.on_step([Bind(epoch=3, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-2")]
    b.on_step([Bind(epoch=4, members=(0, 1, 2, 3)), Release(epoch=3, retract=True)])  # epoch 3 ended first
    assert b.epoch is None and group.sent[-1].next is None and b.last_epoch == 4


def test_a_retracting_release_recomputes_the_tp_requests_in_dp():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-1", kv_len=6)]
    engine.waiting_reqs = [FakeReq("tp-2")]
    b.on_step([Release(epoch=1, retract=True)])
    assert b.epoch is None and isinstance(group.sent[-1], ReleasePlan)
    assert [r.rid for r in engine.waiting_reqs] == ["tp-1", "tp-2"] and engine.waiting_reqs[0].kv_len == 0


def test_commands_for_other_engines_or_old_epochs_are_ignored():
    b, _, _, _, _ = make()
    b.on_step([Bind(epoch=1, members=(1, 2)), Release(epoch=9)])
    assert b.status()["pending"] == 0 and b.epoch is None


def test_the_leader_runs_large_prefill_steps_sequence_parallel_and_tells_the_members():
    b, engine, group, layout, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1), sp_threshold=8)])
    run = lambda fb: b.around_forward(lambda runner, f: None, None, fb)  # noqa: E731
    run({"tokens": [("a", 12, 12)]})  # a 12-token prefill
    run({"tokens": [("a", 13, 1)]})  # its decode
    run({"tokens": [("b", 4, 4)]})  # a small prefill
    assert [m.mode.value for m in group.sent if isinstance(m, Forward)] == ["sp", "tp", "tp"]
    assert [m.value for m in layout.modes] == ["sp", "tp", "tp"]
    assert (b.status()["steps_sp"], b.status()["steps_tp"]) == (1, 2)


def test_a_bind_without_its_own_threshold_takes_the_engines_and_zero_turns_sp_off():
    b, _, group, _, _ = make()
    b.sp_threshold = 4
    b.on_step([Bind(epoch=1, members=(0, 1))])
    b.around_forward(lambda runner, f: None, None, {"tokens": [("a", 6, 6)]})
    b.on_step([Release(epoch=1)])
    b.on_step([Bind(epoch=2, members=(0, 1), sp_threshold=0)])
    b.around_forward(lambda runner, f: None, None, {"tokens": [("a", 6, 6)]})
    assert [m.mode.value for m in group.sent if isinstance(m, Forward)] == ["sp", "tp"]


def test_a_follower_switches_mode_as_each_plan_says():
    from worker_ext.sequence_parallel import StepMode

    plans = [
        Handshake(1),
        Forward({"tokens": [("tp-1", 9, 9)]}, ["tp-1"], mode=StepMode.SP),
        Forward({"tokens": [("tp-1", 10, 1)]}, ["tp-1"]),
        ReleasePlan(),
    ]
    b, engine, _, layout, _ = make(index=1, inbox=plans)
    b.plans.keep_template({"tokens": []})
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert [m.value for m in layout.modes] == ["sp", "tp"] and len(engine.forwards) == 2


def test_a_group_lost_during_an_sp_step_finishes_it_alone_in_tp():
    from worker_ext.sequence_parallel import StepMode

    b, engine, group, layout, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1), sp_threshold=2)])
    calls = []

    def forward(runner, fb):
        calls.append(layout.mode)
        if len(calls) == 1:
            raise RuntimeError("peer gone during the all-to-all")

    b.around_forward(forward, None, {"tokens": [("a", 6, 6)]})
    assert calls == [StepMode.SP, StepMode.TP] and engine.tp_groups[-1] is LOCAL_GROUP


def test_a_request_relayed_too_late_runs_on_the_follower_after_the_release():
    late = FakeReq("late")
    b, engine, _, _, _ = make(index=1, inbox=[Handshake(1), Noop(), ReleasePlan()])
    b.pool.store = None  # nothing reaches the leader
    engine.new_in = [[], [late]]
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.epoch is None and engine.waiting_reqs == [late]


def test_a_leader_sends_members_output_to_them_from_the_bind_on():
    b, engine, _, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert engine.divert is not None
    b.on_step([Release(epoch=1)])
    assert engine.divert is None


def test_the_leader_keeps_back_the_kv_room_its_tightest_member_lacks():
    """A follower whose paused DP work holds KV has less room than the leader: the leader's allocator reports that
    much less, so SGLang retracts or holds back before the follower runs out mid-step."""
    b, engine, group, layout, _ = make(members=(0, 1, 2))
    layout.available = 1000
    group.room = [700, 400]
    b.on_step([Bind(epoch=1, members=(0, 1, 2))])
    mine = 1000 + engine.evictable_physical() * 3
    assert b.epoch is not None and layout.kept_back == mine - 400
    follower, _, fgroup, flayout, _ = make(index=1, members=(0, 1), inbox=[Handshake(1)])
    fgroup.room = [10]
    follower.on_step([Bind(epoch=1, members=(0, 1))])
    assert flayout.kept_back == 0, "only the leader plans steps"


def test_a_lost_peer_is_logged_in_one_line_and_a_fault_of_this_member_with_its_traceback(caplog):
    """A member that stops mid-epoch makes its peers' collectives fail: that is the peer's fate, logged in one
    line (its traceback would only show torch's internals); a fault of this member's own keeps the traceback."""
    b, _, _, _, _ = make(index=1, inbox=[Handshake(1)])
    with caplog.at_level(logging.ERROR, logger="flying.binding"):
        b.on_step([Bind(epoch=1, members=(0, 1))])  # the leader goes silent: its broadcast times out
    (lost,) = [r for r in caplog.records if "aborted" in r.getMessage()]
    assert lost.exc_info is None
    caplog.clear()
    b, engine, _, _, _ = make(index=1, inbox=[Handshake(1), Forward({"tokens": [("tp-1", 9, 9)]}, ["tp-1"])])
    b.plans.keep_template({"tokens": []})
    engine.kv_free = 4
    with caplog.at_level(logging.ERROR, logger="flying.binding"):
        b.on_step([Bind(epoch=1, members=(0, 1))])
    (fault,) = [r for r in caplog.records if "aborted" in r.getMessage()]
    assert fault.exc_info is not None and "FollowerOutOfKV" in fault.getMessage()


def test_a_parking_release_sets_aside_what_no_member_holds_alone_and_a_resume_continues_it():
    b, engine, group, layout, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    long = FakeReq("tp-long", kv_len=6, need=5000, row=3)  # more than the engine's 4,096 KV tokens
    engine.running_reqs = [long]
    sub = layout.sub
    b.on_step([Release(epoch=1, park=True)])
    plan = group.sent[-1]
    assert isinstance(plan, ReleasePlan) and plan.parked == ["tp-long"] and plan.scatter == []
    assert b.epoch is None and engine.running_reqs == [] and long.kv_len == 6  # out of the batch, KV kept
    st = b.status()
    assert (st["mode"], st["parked"], st["park"]) == ("dp", (1,), True)
    assert not engine.idle_checks  # the parked KV belongs to no request the scheduler knows
    b.on_step([Bind(epoch=2, members=(0, 1), resume=1)])
    assert layout.sub is sub  # the parked epoch's slots again, at the same width and rank
    assert engine.running_reqs == [long] and b.status()["parked"] == () and b.status()["epoch"] == 2
    b.on_step([Release(epoch=2)])
    assert b.epoch is not None and b.epoch.release_asked  # it runs on: a plain release waits for it


def test_a_parking_release_scatters_the_requests_an_engine_holds_alone():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-long", kv_len=6, need=5000), FakeReq("tp-short", kv_len=4, need=100)]
    b.on_step([Release(epoch=1, park=True)])
    plan = group.sent[-1]
    assert plan.parked == ["tp-long"] and [h.rid for h in plan.scatter] == ["tp-short"]
    assert b.status()["parked"] == (1,)


def test_a_release_of_a_parked_epoch_ends_its_requests_and_frees_their_kv():
    b, engine, _, layout, changes = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-long", kv_len=6, need=5000, row=engine.alloc_row())]
    sub = layout.sub
    b.on_step([Release(epoch=1, park=True)])
    b.on_step([Release(epoch=1)])  # its group cannot resume (a member is gone)
    assert engine.lost == ["tp-long"] and sorted(sub.freed) == list(range(6))
    assert b.status()["parked"] == () and engine.idle_checks and changes[-1] == "dp"


def test_a_resume_some_member_cannot_serve_ends_the_parked_requests_and_binds_anyway():
    b, engine, group, layout, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    engine.running_reqs = [FakeReq("tp-long", kv_len=6, need=5000, row=engine.alloc_row())]
    b.on_step([Release(epoch=1, park=True)])
    group.room = [0]  # (the members' answers: the other lost its part, a restart)
    b.on_step([Bind(epoch=2, members=(0, 1), resume=1)])
    assert b.status()["epoch"] == 2 and engine.lost == ["tp-long"] and engine.running_reqs == []


def test_a_follower_parks_its_rows_and_its_own_requests_and_takes_them_back_on_the_resume():
    mine = FakeReq("tp-long", output_ids=[1])
    plans = [
        Handshake(1),
        Forward({"tokens": [("tp-long", 4, 4)]}, ["tp-long"]),
        ReleasePlan(scatter=[], parked=["tp-long"]),
    ]
    b, engine, group, _, _ = make(index=1, inbox=plans)
    b.plans.keep_template({"tokens": []})
    b.ownership.hold([mine])
    b.on_step([Bind(epoch=1, members=(0, 1))])
    assert b.epoch is None and b.status()["parked"] == (1,)
    assert len(engine.rows_in_use) == 1 and engine.slots_freed == 0  # its rows and slots for it, kept
    assert mine.finished_reason is None and engine.lost == []
    group.inbox += [
        Handshake(2),
        Forward({"tokens": [("tp-long", 5, 1)]}, ["tp-long"]),
        Noop([Emitted(rid="tp-long", output_ids=[2])]),
        ReleasePlan(),
    ]
    b.on_step([Bind(epoch=2, members=(0, 1), resume=1)])
    assert engine.forwards[0][0] == engine.forwards[1][0]  # the same row, grown by the next token
    assert mine.output_ids == [1, 2] and b.status()["parked"] == ()


def test_a_long_request_in_its_prefill_starts_over_later_instead_of_holding_the_park_up():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    prefilling = FakeReq("tp-long", kv_len=64, need=5000)
    engine.running_reqs, engine.chunked, engine.clean = [FakeReq("tp-short", kv_len=4)], prefilling, False
    b.on_step([Release(epoch=1, park=True)])
    assert engine.lost == ["tp-long"] and b.epoch is not None  # aborted (the gateway queues it again) ...
    engine.clean = True
    b.on_step([])
    assert b.epoch is None and group.sent[-1].parked == []  # ... and the rest scatters at the next boundary
    assert b.status()["parked"] == ()


def test_a_members_request_aborted_in_its_prefill_gets_its_end_through_the_outbox():
    b, engine, group, _, _ = make()
    b.on_step([Bind(epoch=1, members=(0, 1))])
    copy = FakeReq("tp-theirs", kv_len=64, need=5000)
    b.ownership.add_copy(copy, owner=1)
    engine.running_reqs, engine.chunked, engine.clean = [FakeReq("tp-short", kv_len=4)], copy, False
    b.plans._last_sent = 0.0
    b.on_step([Release(epoch=1, park=True)])
    sent = group.sent[-1]
    assert isinstance(sent, Noop) and [em.rid for em in sent.emit] == ["tp-theirs"]
    assert sent.emit[0].finished_reason is not None and not b.ownership.has_copies


def test_a_follower_that_reads_the_park_after_carrying_it_out_keeps_what_it_parked():
    plans = [Handshake(1), Forward({"tokens": [("tp-long", 4, 4)]}, ["tp-long"]),
             ReleasePlan(scatter=[], parked=["tp-long"])]  # fmt: skip
    b, engine, _, _, _ = make(index=1, inbox=plans)
    b.plans.keep_template({"tokens": []})
    b.on_step([Bind(epoch=1, members=(0, 1))])
    b.on_step([Release(epoch=1, park=True)])  # its own copy of the command, read once back in its loop
    assert b.status()["parked"] == (1,) and engine.lost == []
