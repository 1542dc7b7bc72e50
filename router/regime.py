"""Light or busy load: the regime that says whether load groups may form (paper section 5, load adaptation).

``inflight``: demand (queued + inflight) against the groups' capacity (``light_load`` / ``busy_load`` of
``tp_inflight_per_engine`` per engine). ``rate``: the admission rate per engine (``light_rate`` / ``busy_rate``,
an exponential average over ``rate_tau_s``), which sees a burst begin and end at once, where demand lags behind
the backlog. Either way a normal request that waited ``busy_wait_s`` is *pressure*, light needs none (while
servable requests wait, groups would only take capacity away), and light must last ``calm_s``. A queue that only waits for load groups forming at their members' next step boundary is not pressure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from flying.messages import Group, RouterState
from router.config import PolicyConfig
from router.decision import RegimeNote
from router.round import Round
from router.snapshot import Snapshot


@dataclass(frozen=True)
class Regime:
    """The verdict of one round: the new state, whether load is pressing (busy thresholds crossed, or normal work
    waits), and a note when the regime changed."""

    state: RouterState
    pressure: bool
    note: RegimeNote | None = None


def admission_rate(state: RouterState, admitted: int, now: float, tau: float) -> RouterState:
    """Admissions per second: each admission adds 1/tau, the sum decays with time constant tau (exact for any
    spacing of rounds). A counter that went back (Redis flushed) restarts the count."""
    new = admitted - state.admitted if state.rate_ts and admitted >= state.admitted else 0
    dt = max(0.0, now - state.rate_ts) if state.rate_ts else 0.0
    rate = state.rate * math.exp(-dt / tau) + new / tau
    return msgspec.structs.replace(state, rate=rate, rate_ts=now, admitted=admitted)


def forming(groups: Iterable[Group], now: float, ack_timeout_s: float) -> bool:
    """A load group binds at its members' next step boundary (hard or adoption; not one that drains), for at
    most ``ack_timeout_s`` so far, or formed this very round (the requests that waited for it go to it now)."""
    return any(
        g.reason == "load"
        and g.preempt == "hard"
        and (
            (g.state == "binding" and now - g.since <= ack_timeout_s)
            or (g.state == "bound" and g.since >= now)
        )
        for g in groups
    )


def judge(s: Snapshot, state: RouterState, cfg: PolicyConfig, groups_forming: bool) -> Regime:
    """The regime after snapshot ``s``, from the previous ``state``; ``groups_forming``: see :func:`forming`."""
    n = len({e.engine for e in s.engines})
    st = admission_rate(state, s.admitted, s.now, cfg.rate_tau_s)
    rate = st.rate
    demand = s.demand
    oldest = max((s.now - r.enqueued_at for r in s.waiting if s.dp_fit(r)), default=0.0)
    if not st.busy and groups_forming:
        oldest = 0.0  # light: the queue waits for groups that form at the members' next step boundary
    if cfg.regime == "rate":
        heavy = rate > cfg.busy_rate * n
        light = rate <= cfg.light_rate * n
    else:
        heavy = demand > cfg.busy_load * cfg.tp_inflight_per_engine * n
        light = demand <= cfg.light_load * cfg.tp_inflight_per_engine * n
    # pressure: normal work queues, or demand is above what the groups would hold (the busy trigger)
    pressure = oldest > cfg.busy_wait_s or heavy
    replace = msgspec.structs.replace
    if not cfg.load_adaptation or n == 0:
        return Regime(replace(st, busy=True, calm_since=0.0), pressure)
    if st.busy:
        calm = (st.calm_since or s.now) if light else 0.0
        if light and not pressure and s.now - calm >= cfg.calm_s:
            note = RegimeNote(busy=False, demand=demand, rate=rate, engines=n)
            return Regime(replace(st, busy=False, calm_since=calm, changed_at=s.now), pressure, note)
        return Regime(replace(st, busy=True, calm_since=calm), pressure)
    if pressure:
        note = RegimeNote(busy=True, demand=demand, rate=rate, engines=n, oldest_s=oldest)
        return Regime(replace(st, busy=True, calm_since=0.0, changed_at=s.now), pressure, note)
    return Regime(st, pressure)


def update(rnd: Round) -> None:
    """Judge the round's regime and record it (state, pressure, note)."""
    verdict = judge(
        rnd.s, rnd.out.state, rnd.cfg, forming(rnd.groups.values(), rnd.now, rnd.cfg.ack_timeout_s)
    )
    rnd.out.state, rnd.pressure = verdict.state, verdict.pressure
    if verdict.note is not None:
        rnd.out.events.append(verdict.note)
