"""The load regime alone (router.regime): the admission rate, groups forming, and the light/busy verdict."""

from __future__ import annotations

import math

from flying.messages import Group, QueuedRequest, RouterState
from router.config import PolicyConfig
from router.engine_view import EngineView
from router.regime import admission_rate, forming, judge
from router.snapshot import Snapshot

CFG = PolicyConfig(
    regime="inflight", calm_s=2.0, busy_wait_s=0.25, light_load=0.5, busy_load=1.0, tp_inflight_per_engine=4
)


def engines(n=4, inflight=0):
    return [EngineView(i, f"e{i}", inflight, 1000, 1000, num_engines=n) for i in range(n)]


def req(at=100.0, priority="normal"):
    return QueuedRequest(id="r", priority=priority, model="m", prompt_tokens=10, max_tokens=10, gateway="g", enqueued_at=at)  # fmt: skip


def snap(now=100.0, waiting=(), queued=0, es=None, admitted=0):
    return Snapshot(now=now, waiting=list(waiting), queued=queued, engines=engines() if es is None else es,
                    groups=[], admitted=admitted)  # fmt: skip


def test_the_admission_rate_decays_and_adds_one_over_tau_per_admission():
    st = RouterState(rate=2.0, rate_ts=10.0, admitted=5)
    out = admission_rate(st, admitted=9, now=12.0, tau=2.0)
    assert math.isclose(out.rate, 2.0 * math.exp(-1) + 4 / 2.0) and (out.rate_ts, out.admitted) == (12.0, 9)
    assert math.isclose(admission_rate(st, admitted=1, now=12.0, tau=2.0).rate, 2.0 * math.exp(-1)), "reset"
    assert admission_rate(RouterState(), admitted=50, now=3.0, tau=2.0).rate == 0.0, (
        "the first round counts none"
    )


def test_only_hard_load_binds_younger_than_ack_timeout_are_forming():
    g = Group(epoch=1, members=(0, 1), reason="load", state="binding", since=99.0)
    assert forming([g], now=100.0, ack_timeout_s=2.0)
    assert not forming([g], now=102.5, ack_timeout_s=2.0)
    assert not forming([Group(epoch=1, members=(0, 1), reason="load", state="binding", preempt="sequential")], 0.0, 2.0)  # fmt: skip
    assert not forming([Group(epoch=1, members=(0, 1), reason="priority", state="binding")], 0.0, 2.0)


def test_light_load_must_last_calm_s_and_says_so_once():
    busy = RouterState(busy=True)
    first = judge(snap(now=100.0), busy, CFG, False)
    assert first.state.busy and first.state.calm_since == 100.0 and first.note is None and not first.pressure
    later = judge(snap(now=102.0), first.state, CFG, False)
    assert not later.state.busy and later.state.changed_at == 102.0
    assert later.note is not None and not later.note.busy and later.note.engines == 4


def test_a_waiting_normal_request_is_pressure_and_turns_light_load_busy():
    v = judge(snap(now=100.0, waiting=[req(at=99.5)], queued=1), RouterState(busy=False), CFG, False)
    assert v.pressure and v.state.busy and v.note is not None and v.note.busy and v.note.oldest_s == 0.5


def test_a_queue_waiting_for_forming_groups_is_no_pressure():
    v = judge(snap(now=100.0, waiting=[req(at=99.5)], queued=1), RouterState(busy=False), CFG, True)
    assert not v.pressure and not v.state.busy and v.note is None


def test_high_priority_waits_are_no_pressure_but_demand_above_busy_load_is():
    assert not judge(snap(waiting=[req(at=90.0, priority="high")], queued=1), RouterState(busy=False), CFG, False).pressure  # fmt: skip
    heavy = judge(snap(es=engines(inflight=5)), RouterState(busy=False), CFG, False)
    assert heavy.pressure and heavy.state.busy


def test_without_load_adaptation_or_engines_it_stays_busy():
    off = PolicyConfig(load_adaptation=False)
    assert judge(snap(now=500.0), RouterState(busy=True, calm_since=1.0), off, False).state.busy
    assert judge(snap(es=[]), RouterState(busy=False), CFG, False).state.busy


def test_the_rate_regime_reads_admissions_per_engine():
    cfg = PolicyConfig(regime="rate", light_rate=0.75, busy_rate=1.0, rate_tau_s=1.0)
    st = RouterState(busy=False, rate_ts=99.0, admitted=0)
    assert judge(snap(admitted=5), st, cfg, False).pressure, "5 per second on 4 engines is above 1 per engine"
    assert not judge(snap(admitted=3), st, cfg, False).pressure


def test_light_load_while_servable_requests_wait_stays_busy_and_does_not_flap():
    """Few admissions, but a normal request waits beyond busy_wait_s (an engine lost, the rest full): load is
    not light, round after round (turning light there only to turn busy again at the next round flapped the
    regime and its decision log at every round)."""
    cfg = PolicyConfig(regime="rate", calm_s=0.0, busy_wait_s=0.1)
    st, changes = RouterState(busy=True), 0
    for k in range(20):
        now = 100.0 + 0.05 * k
        verdict = judge(snap(now=now, waiting=[req(at=99.0)], queued=1), st, cfg, groups_forming=False)
        changes += verdict.note is not None
        st = verdict.state
    assert st.busy and changes == 0
    verdict = judge(snap(now=102.0), st, cfg, groups_forming=False)  # served: nothing waits any more
    assert not verdict.state.busy and verdict.note is not None
