"""The bind/release policy (paper section 5): a pure, deterministic function of a cluster snapshot -> decisions.

No Redis, no clocks, no randomness: the live router (router.dispatcher), the unit tests and the simulator
(sim.simulator) all call :func:`decide` with a :class:`Snapshot` and apply the :class:`Decision` it returns.

The three use cases, each switchable in :class:`PolicyConfig`:

- *load adaptation*: after ``calm_s`` of light load engines bind into ``light_width`` groups and normal traffic goes
  to them (TP latency). Light and busy are judged (``regime``) by demand (queued + inflight against
  ``light_load`` / ``busy_load`` of the groups' capacity, ``tp_inflight_per_engine`` per engine) or by the admission
  rate per engine (``light_rate`` / ``busy_rate``, an exponential average over ``rate_tau_s``), which sees a burst
  begin and end at once while demand lags behind its backlog. An idle block binds at once. A busy one binds at
  once by *adoption* where every member transforms KV (``kv_transform``) and the transformation is cheap
  (``adopt_max_ms``; members holding at most ``adopt_max_inflight`` requests each, a larger backlog stays in DP);
  otherwise it drains first (sequential: it gets no new work, at most half of the blocks still in DP drain at a
  time), so nothing is paused or recomputed. Under *pressure* (a normal request waited ``busy_wait_s``, or demand or
  rate above the busy threshold) load groups are released at once, by *scatter* (each TP request continues in DP on
  the engine that owns it, KV moved, no recompute) where the members transform KV, else by retraction (recomputed
  in DP on the leader), and everything runs DP until load is light again;
- *priority*: high-priority requests are placed before anything else. One goes to a group with room that forms
  at the next step boundary, else binds a ``priority_width`` group (``priority_preempt``, hard by default: the
  members' DP requests pause with their KV kept; by adoption where the members transform KV: they continue in the
  group) that leaves DP engines for everyone else: under light load the least loaded block, under pressure only an
  idle one (pausing busy engines costs more than the group saves), else it jumps the queue in DP;
- *long context*: a request whose prompt plus max tokens exceeds one engine's KV goes to the narrowest long group
  whose pooled KV holds it, or an idle group (re-labelled), or binds the smallest width that fits
  (``long_preempt``, sequential by default so the members' KV is free; hard only where their free KV holds it, and
  then by adoption where the members transform KV).
  Under pressure it waits up to ``long_wait_s`` first, and long groups hold at most ``long_max_share`` of the
  engines (one is always allowed), so a burst is served in DP.

KV transformation (Gyges-style, issue 12) is used only where every member's heartbeat reports ``kv_transform`` and
``PolicyConfig.kv_transform`` is on (``flying-router --no-kv-transform``); otherwise every decision is as without it.
Its cost enters the decision: an adoption's stall is estimated from the members' KV in use (head slices of
``kv_bytes_per_token`` over ``kv_link_gbps`` plus ``kv_transform_fixed_ms``, :mod:`router.transform_cost`); above
``adopt_max_ms`` the block drains instead. A group bound by adoption pauses nothing, so ``max_defer_s`` does not
apply to it; its adopted requests stay owned by their members, so it is never released by retraction (only by
scatter, or by waiting). Hysteresis: light needs ``calm_s`` of light load, the thresholds leave a band between
light and busy, and a queue that only waits for load groups forming at their members' next step boundary is not
pressure. DP dispatch is least loaded, counting requests sent within about ``spread_s`` twice (a released group's
follower, whose TP requests its leader owns, would otherwise take every new request at once); cache-aware
(``dispatch``, issue 16) it follows the prompt's prefix (:meth:`_Round.pick_dp`) to the engine whose cache probably
holds most of it (:mod:`router.prefix_index`, which the caller keeps), unless loads are out of balance. TP
dispatches ignore prefixes: a group's requests bypass the prefix cache.

Groups are reused (Gyges): the next high-priority or long request goes to a group that is already bound; priority
and long groups are released only after ``keep_s`` without TP work. DP work a bind pauses (hard preemption) waits at
most ``max_defer_s``: the group is then released by retraction (its requests continue in DP on the leader, unless
one needs the pooled KV), so the paused work resumes at the next step boundary.

Safety: every bind gets a fresh epoch (assigned by the caller), its record is written before its commands are sent,
members are picked only among engines in no group record, so groups never overlap and an engine is in at most one
epoch; members that do not acknowledge a bind within ``ack_timeout_s`` (or finish it within ``bind_timeout_s``)
roll it back with a release and are not picked for another bind for ``suspect_s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from flying.groups import merge_sets
from flying.groups import widths as group_widths
from flying.messages import FastTarget, Group, GroupReason, GroupState, Preempt, QueuedRequest, RouterState
from router.decision import (
    BindMode,
    BindNote,
    Decision,
    Dispatch,
    DistrustNote,
    DpRule,
    RegimeNote,
    ReleaseCause,
    ReleaseMode,
    ReleaseNote,
)
from router.engine_view import EngineView
from router.prefix_index import PrefixIndex
from router.transform_cost import adopt_moves, kv_transform_ms

DispatchRule = Literal["cache-aware", "least-loaded"]


@dataclass(frozen=True)
class PolicyConfig:
    load_adaptation: bool = True
    priority: bool = True
    long_context: bool = True
    light_width: int = 2  # width of the groups formed under light load
    priority_width: int = 2  # width of a group bound for a high-priority request
    priority_preempt: Preempt = "hard"
    long_preempt: Preempt = "sequential"  # hard only where the members' free KV holds the request
    max_inflight_per_worker: int = 32  # requests one DP engine is handed before the rest wait in Redis
    spread_s: float = 0.0  # DP dispatch also counts the requests an engine was sent within about this long
    tp_inflight_per_engine: int = 4  # a group of width w takes w * this TP requests at once
    regime: Literal["inflight", "rate"] = "inflight"  # what says light or busy load (see update_regime)
    light_load: float = (
        0.5  # light: queued + inflight <= this share of the groups' capacity (all engines bound) ...
    )
    calm_s: float = 2.0  # ... for this long before load groups form
    busy_load: float = 1.0  # busy: queued + inflight above this share of the groups' capacity (or a wait)
    light_rate: float = 0.75  # rate regime: light at most this many admissions per second per engine ...
    busy_rate: float = 1.0  # ... busy above this many
    rate_tau_s: float = 2.0  # time constant of the admission rate's exponential average
    busy_wait_s: float = 0.25  # busy: a normal request has waited this long in the queue
    keep_s: float = 1.0  # a priority/long group without TP work for this long is released
    long_max_share: float = 0.5  # long groups hold at most this share of the engines (the rest stay DP)
    long_wait_s: float = 60.0  # under busy load a long request waits up to this long before binding
    max_defer_s: float = 5.0  # a bind pauses DP work at most this long (then released, retracting)
    ack_timeout_s: float = 2.0  # members must acknowledge a bind within this ...
    bind_timeout_s: float = 60.0  # ... and complete it within this (a sequential bind drains DP work first)
    suspect_s: float = 10.0  # a member that failed a bind is not picked for another one for this long
    # KV transformation (Bind.adopt / Release.scatter), used only where every member's heartbeat says kv_transform
    kv_transform: bool = True
    adopt_max_ms: float = 100.0  # a bind adopts only if its estimated transformation stalls the group <= this
    adopt_max_inflight: int = 64  # ... and its members hold at most this many DP requests each
    kv_bytes_per_token: int = 163_840  # for that estimate (Llama-3-70B, FP8 KV); see router.transform_cost
    kv_link_gbps: float = 360.0  # per member and direction
    kv_transform_fixed_ms: float = 4.0
    # DP dispatch (issue 16): by prefix affinity (router.prefix_index), or least loaded only
    dispatch: DispatchRule = "cache-aware"
    cache_threshold: float = 0.3  # follow the engine holding most of the prompt, at least this share ...
    balance_abs_threshold: float = 8.0  # ... unless loads differ by more than this ...
    balance_rel_threshold: float = 1.5  # ... and the highest is above this times the lowest

    def __post_init__(self) -> None:
        for name in ("light_width", "priority_width"):
            w = getattr(self, name)
            assert w >= 2 and w & (w - 1) == 0, f"{name} must be a power of two >= 2, got {w}"
        assert self.max_inflight_per_worker >= 1 and self.tp_inflight_per_engine >= 1
        assert self.light_load >= 0 and self.calm_s >= 0 and self.busy_wait_s > 0
        assert 0 <= self.light_rate <= self.busy_rate and self.rate_tau_s > 0
        assert 0 < self.ack_timeout_s <= self.bind_timeout_s, "need 0 < ack_timeout_s <= bind_timeout_s"
        assert 0 <= self.cache_threshold <= 1, f"cache_threshold {self.cache_threshold} not in [0, 1]"
        assert self.balance_abs_threshold >= 0 and self.balance_rel_threshold >= 1


@dataclass(frozen=True)
class GroupLoad:
    """TP requests assigned to one group (epoch) and not finished."""

    inflight: int = 0
    kv_tokens: int = 0
    max_kv_tokens: int = 0  # the largest one's (a request one engine cannot hold cannot be retracted to DP)


@dataclass(frozen=True)
class Snapshot:
    now: float
    waiting: Sequence[QueuedRequest]  # the head of the queue in dispatch order (priority class, then arrival)
    queued: int  # the whole queue's depth
    engines: Sequence[EngineView]  # live engines only
    groups: Sequence[Group]  # the router's group records
    tp_load: Mapping[int, GroupLoad] = field(default_factory=dict)
    state: RouterState = field(default_factory=RouterState)
    admitted: int = 0  # requests admitted so far (a monotonic counter; the rate regime's input)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # read only: the caller syncs and records


USABLE: tuple[GroupState, ...] = ("bound", "binding")
# groups a request one engine holds may go to (a long prefill would stall it)
SHORT: tuple[GroupReason, ...] = ("load", "priority", "manual")


def _replace(g: Group, **kw: object) -> Group:
    return msgspec.structs.replace(g, **kw)


def need_width(kv_tokens: int, engines: Sequence[EngineView]) -> int | None:
    """1 if one engine holds ``kv_tokens``; else the smallest group width whose pooled KV does; None if none."""
    if not engines:
        return None
    if any(e.max_total_tokens >= kv_tokens for e in engines):
        return 1
    bindable = [e for e in engines if e.num_engines > 1]
    if not bindable:
        return None
    per_engine = min(e.max_total_tokens for e in bindable)
    for w in group_widths(max(e.num_engines for e in bindable))[1:]:
        if w * per_engine >= kv_tokens:
            return w
    return None


class _Round:
    """One call of :func:`decide`: the snapshot plus what this round has already handed out."""

    def __init__(self, s: Snapshot, cfg: PolicyConfig) -> None:
        self.s, self.cfg, self.now = s, cfg, s.now
        self.live = {e.engine: e for e in s.engines}
        self.groups: dict[int, Group] = {g.epoch: g for g in s.groups}
        self.out = Decision(state=msgspec.structs.replace(s.state, long_context=cfg.long_context))
        self.dp_inflight = {e.engine: e.inflight for e in s.engines}
        self.dp_kv = {e.engine: 0 for e in s.engines}  # KV of the DP requests this round sends each engine
        self.tp = {ep: (ld.inflight, ld.kv_tokens) for ep, ld in s.tp_load.items()}
        self.tp_max = {ep: ld.max_kv_tokens for ep, ld in s.tp_load.items()}
        self.reserved: set[int] = set()  # members of binds planned this round
        self.pressure = False  # set by update_regime
        self.suspect = {e: t for e, t in s.state.suspect.items() if t > s.now}
        self.recent = self.decayed_recent()
        self.sent: dict[int, set[int]] = {}  # engine -> chain hashes this round sends it (DP)

    def decayed_recent(self) -> dict[int, float]:
        """DP dispatches per engine, decayed with time constant ``spread_s`` since the last round (rate_ts)."""
        st, tau = self.s.state, self.cfg.spread_s
        if tau <= 0 or not st.recent:
            return {}
        f = math.exp(-max(0.0, self.now - st.rate_ts) / tau) if st.rate_ts else 1.0
        return {e: v * f for e, v in st.recent.items() if v * f >= 0.01 and e in self.live}

    # --- group records ------------------------------------------------------------------------------------

    def put(self, g: Group) -> None:
        self.groups[g.epoch] = g
        self.out.put[g.epoch] = g

    def release(
        self,
        g: Group,
        cause: ReleaseCause,
        mode: ReleaseMode = ReleaseMode.WAIT,
        seconds: float = 0.0,
        engines: tuple[int, ...] = (),
        width: int = 0,
    ) -> None:
        """Mark ``g`` releasing and send its members the release (the figures: :class:`ReleaseNote`'s)."""
        self.put(_replace(g, state="releasing", since=self.now))
        self.out.release(ReleaseNote(g.epoch, g.members, g.reason, mode, cause, seconds, engines, width))

    def release_now(self, g: Group, cause: ReleaseCause, seconds: float = 0.0) -> None:
        """Release at once: by scatter where the members transform KV (each TP request continues in DP on its
        owner, KV moved, no recompute), else by retraction (recomputed in DP on the leader); a group holding a
        request that needs the pooled KV, or one bound by adoption whose members cannot scatter (its adopted
        requests' streams are on their owners, not on the leader), waits for its TP requests instead."""
        if not self.retractable(g):
            self.release(g, cause, seconds=seconds)
        elif self.can_transform(g.members):
            self.release(g, cause, ReleaseMode.SCATTER, seconds)
        else:
            self.release(g, cause, ReleaseMode.WAIT if g.adopt else ReleaseMode.RETRACT, seconds)

    def in_groups(self) -> set[int]:
        return {m for g in self.groups.values() for m in g.members} | self.reserved

    def reconcile(self) -> None:
        """Move records along with what the engines' heartbeats say."""
        for g in list(self.groups.values()):
            beats = [self.live.get(m) for m in g.members]
            age = self.now - g.since
            if g.state == "releasing":
                if all(
                    b is None or (b.epoch != g.epoch and b.pending != g.epoch and b.beat_ts >= g.since)
                    for b in beats
                ):
                    del self.groups[g.epoch]
                    self.out.put.pop(g.epoch, None)
                    self.out.drop.append(g.epoch)
                continue
            if any(b is None for b in beats):
                self.release(g, ReleaseCause.MEMBER_GONE)
            elif g.state == "binding":
                if all(b.epoch == g.epoch for b in beats):  # type: ignore[union-attr]
                    self.put(_replace(g, state="bound", since=self.now, last_used=self.now))
                elif age > self.cfg.ack_timeout_s and (
                    silent := [b.engine for b in beats if g.epoch not in (b.epoch, b.pending)]  # type: ignore[union-attr]
                ):
                    self.release(
                        g,
                        ReleaseCause.NOT_ACKNOWLEDGED,
                        seconds=self.cfg.ack_timeout_s,
                        engines=tuple(silent),
                    )
                    self.distrust(silent)
                elif age > self.cfg.bind_timeout_s:
                    self.release(g, ReleaseCause.NOT_BOUND, seconds=self.cfg.bind_timeout_s)
                    self.distrust([b.engine for b in beats if b.epoch != g.epoch])  # type: ignore[union-attr]
            elif any(b.epoch != g.epoch for b in beats):  # type: ignore[union-attr]
                self.release(g, ReleaseCause.BROKE_UP)

    def distrust(self, engines: list[int]) -> None:
        """Members that failed a bind are left out of binds for ``suspect_s`` (retrying at once would stall the
        requests waiting for a group again); they keep serving DP."""
        for e in engines:
            self.suspect[e] = self.now + self.cfg.suspect_s
        self.out.events.append(DistrustNote(tuple(engines), self.cfg.suspect_s))

    # --- KV transformation (Gyges-style: head slices move within the group) -----------------------------------

    def can_transform(self, members: Sequence[int]) -> bool:
        """Adopt/scatter only where it is on and every member's heartbeat says it applies them."""
        return self.cfg.kv_transform and all(m in self.live and self.live[m].kv_transform for m in members)

    def used_kv(self, m: int) -> int:
        """KV tokens engine ``m``'s DP requests hold (heartbeat), those this round sends it included."""
        e = self.live[m]
        return max(0, e.max_total_tokens - e.free_kv_tokens) + self.dp_kv[m]

    def adopt_ms(self, members: Sequence[int]) -> float:
        """Estimated stall of an adoption: every member's DP KV moves (d-1)/d of its head slices."""
        c = self.cfg
        moves = adopt_moves([self.used_kv(m) for m in members])
        return kv_transform_ms(moves, c.kv_bytes_per_token, c.kv_link_gbps, c.kv_transform_fixed_ms)

    def may_adopt(self, members: Sequence[int]) -> bool:
        """Adoption beats draining or pausing the members' DP work when its stall is at most ``adopt_max_ms``
        (a few decode steps); a larger one (members full of KV) drains or pauses as without it."""
        return self.can_transform(members) and self.adopt_ms(members) <= self.cfg.adopt_max_ms

    # --- load adaptation ----------------------------------------------------------------------------------

    def fits_one(self, r: QueuedRequest) -> bool:
        return any(e.max_total_tokens >= r.kv_tokens for e in self.s.engines)

    def dp_fit(self, r: QueuedRequest) -> bool:
        return r.priority != "high" and self.fits_one(r)

    def update_rate(self) -> float:
        """Admissions per second: each admission adds 1/tau, the sum decays with time constant tau (exact for any
        spacing of rounds). A counter that went back (Redis flushed) restarts the count."""
        st, tau = self.out.state, self.cfg.rate_tau_s
        new = self.s.admitted - st.admitted if st.rate_ts and self.s.admitted >= st.admitted else 0
        dt = max(0.0, self.now - st.rate_ts) if st.rate_ts else 0.0
        rate = st.rate * math.exp(-dt / tau) + new / tau
        self.out.state = msgspec.structs.replace(st, rate=rate, rate_ts=self.now, admitted=self.s.admitted)
        return rate

    def forming(self) -> bool:
        """A load group binds at its members' next step boundary (hard or adoption; not one that drains), for at
        most ``ack_timeout_s`` so far."""
        return any(
            g.reason == "load" and g.state == "binding" and g.preempt == "hard"
            and self.now - g.since <= self.cfg.ack_timeout_s
            for g in self.groups.values()
        )  # fmt: skip

    def update_regime(self) -> None:
        """Light or busy load. ``inflight``: demand (queued + inflight) against the groups' capacity
        (``light_load`` / ``busy_load``). ``rate``: the admission rate per engine (``light_rate`` /
        ``busy_rate``), which sees a burst begin and end at once, where demand lags behind the backlog. Either
        way a normal request that waited ``busy_wait_s`` is pressure, and light must last ``calm_s``."""
        cfg, n = self.cfg, len(self.live)
        rate = self.update_rate()
        st = self.out.state
        demand = self.s.queued + sum(e.inflight for e in self.s.engines)
        oldest = max((self.now - r.enqueued_at for r in self.s.waiting if self.dp_fit(r)), default=0.0)
        if not st.busy and self.forming():
            oldest = 0.0  # light: the queue waits for groups that form at the members' next step boundary
        if cfg.regime == "rate":
            heavy = rate > cfg.busy_rate * n
            light = rate <= cfg.light_rate * n
        else:
            heavy = demand > cfg.busy_load * cfg.tp_inflight_per_engine * n
            light = demand <= cfg.light_load * cfg.tp_inflight_per_engine * n
        # pressure: normal work queues, or demand is above what the groups would hold (the busy trigger)
        self.pressure = oldest > cfg.busy_wait_s or heavy
        if not cfg.load_adaptation or n == 0:
            self.out.state = msgspec.structs.replace(st, busy=True, calm_since=0.0)
            return
        if st.busy:
            calm = (st.calm_since or self.now) if light else 0.0
            if light and self.now - calm >= cfg.calm_s:
                self.out.state = msgspec.structs.replace(st, busy=False, calm_since=calm, changed_at=self.now)
                self.out.events.append(RegimeNote(busy=False, demand=demand, rate=rate, engines=n))
            else:
                self.out.state = msgspec.structs.replace(st, busy=True, calm_since=calm)
        elif self.pressure:
            self.out.state = msgspec.structs.replace(st, busy=True, calm_since=0.0, changed_at=self.now)
            self.out.events.append(
                RegimeNote(busy=True, demand=demand, rate=rate, engines=n, oldest_s=oldest)
            )

    # --- releases -----------------------------------------------------------------------------------------

    def other_work(self, g: Group) -> int:
        """Requests on the members that were not dispatched to the group (their inflight, less its TP requests):
        the DP work its bind set aside, or, bound by adoption, the DP requests it adopted."""
        n = sum(self.live[m].inflight for m in g.members if m in self.live)
        return n - self.s.tp_load.get(g.epoch, GroupLoad()).inflight  # (the snapshot's: inflight is too)

    def paused_dp(self, g: Group) -> int:
        """DP requests the bind set aside on its members (none when it adopted them: they run in the group)."""
        return 0 if g.adopt else self.other_work(g)

    def group_n(self, g: Group) -> int:
        """The group's TP requests: those dispatched to it, and those it adopted."""
        return self.tp.get(g.epoch, (0, 0))[0] + (self.other_work(g) if g.adopt else 0)

    def releases(self) -> None:
        busy, cfg = self.out.state.busy, self.cfg
        queued_dp = any(self.dp_fit(r) for r in self.s.waiting)
        queued_tp = any(  # requests that would go to a group: an idle one is not released under them
            (r.priority == "high" and cfg.priority) or not self.fits_one(r) for r in self.s.waiting
        )
        for g in list(self.groups.values()):
            if g.state == "releasing" or g.reason == "manual":
                continue
            tp_busy = self.group_n(g) > 0
            if tp_busy and g.state == "bound" and self.now - g.last_used > 0.5:
                g = _replace(
                    g, last_used=self.now
                )  # in use, maybe by fast-path requests the round never placed
                self.put(g)
            if g.reason == "load" and busy:
                # its requests continue in DP (scattered to their owners, or retracted to the leader), unless one
                # of them needs the group's pooled KV
                self.release_now(g, ReleaseCause.LOAD_ROSE)
            elif (
                g.state == "bound"
                and self.now - g.since >= cfg.max_defer_s
                and (self.paused_dp(g) > 0 or (busy and queued_dp))
            ):
                # paused DP work resumes now: the group's requests continue in DP (unless one of them needs the
                # group's pooled KV); DP work that only queues waits for the group's requests instead, unless they
                # can move to their owners by scatter (no recompute)
                why, after = ReleaseCause.DP_DEFERRED, cfg.max_defer_s
                if self.paused_dp(g) > 0 or self.can_transform(g.members):
                    self.release_now(g, why, seconds=after)
                else:
                    self.release(g, why, seconds=after)
            elif (
                g.state == "bound" and not tp_busy and not queued_tp and self.now - g.last_used >= cfg.keep_s
            ):
                if not busy and g.width == cfg.light_width and not self.paused_dp(g):
                    self.put(_replace(g, reason="load"))  # light load: keep it, as a load group
                elif busy or g.reason == "long" or self.paused_dp(g):
                    self.release(g, ReleaseCause.NO_TP_WORK, seconds=cfg.keep_s)

    def retractable(self, g: Group) -> bool:
        """The group's requests can continue in DP on its leader (none needs the group's pooled KV)."""
        return self.tp_max.get(g.epoch, 0) <= min(self.live[m].max_total_tokens for m in g.members)

    # --- binds and dispatch -------------------------------------------------------------------------------

    def free_sets(self, width: int) -> list[tuple[int, ...]]:
        """Merge sets of ``width`` whose members are live, bindable, in DP and in no group; least loaded first."""
        taken = self.in_groups()
        n = max((e.num_engines for e in self.s.engines), default=1)
        if width > n:
            return []
        ok = []
        for ms in merge_sets(n, (width,)) if n > 1 else []:
            es = [self.live.get(m) for m in ms]
            if all(
                e is not None
                and e.num_engines == n
                and e.mode == "dp"
                and not e.pending
                and m not in taken
                and m not in self.suspect
                for m, e in zip(ms, es)
            ):
                ok.append(ms)
        return sorted(ok, key=lambda ms: (self.block_load(ms), ms))

    def hard_cap(self, members: tuple[int, ...]) -> int:
        """KV a hard-preempted group can use: its members' paused DP requests keep theirs, those this round sends
        them included (with a margin of a tenth, for the tokens they decode before they read the bind)."""
        return int(0.9 * sum(self.live[m].free_kv_tokens - self.dp_kv[m] for m in members))

    def bind(
        self, members: tuple[int, ...], reason: GroupReason, preempt: Preempt, adopt: bool = False
    ) -> Group:
        """A new group record; ``adopt``: by adoption (the members' DP requests become its TP requests, their KV
        transformed; it forms at the members' next step boundary, like a hard bind, and pauses nothing)."""
        g = Group(
            epoch=0,
            members=members,
            reason=reason,
            preempt="hard" if adopt else preempt,
            since=self.now,
            last_used=self.now,
            kv_cap=self.hard_cap(members) if preempt == "hard" or adopt else 0,
            adopt=adopt,
        )
        self.out.binds.append(g)
        self.reserved |= set(members)
        note = (
            BindNote(members, reason, BindMode.ADOPT, self.adopt_ms(members))
            if adopt
            else BindNote(members, reason, BindMode(preempt))
        )
        self.out.events.append(note)
        return g

    def group_room(self, g: Group, r: QueuedRequest) -> bool:
        """Room for ``r``: fewer TP requests than the group takes, and KV for it. A hard-bound group's KV is capped
        while its members hold paused DP work (kv_cap); once they hold none, the members' whole KV is the group's."""
        kv = self.tp.get(g.epoch, (0, 0))[1]
        full = g.width * min(self.live[m].max_total_tokens for m in g.members)
        pooled = g.kv_cap if g.kv_cap and self.other_work(g) > 0 else full
        n = self.tp.get(g.epoch, (0, 0))[
            0
        ]  # (adopted requests do not count: they were the members' own load)
        return n < g.width * self.cfg.tp_inflight_per_engine and kv + r.kv_tokens <= pooled

    def group_for(
        self,
        r: QueuedRequest,
        width: int,
        states: tuple[GroupState, ...],
        reasons: tuple[GroupReason, ...] | None = None,
        imminent: bool = False,
    ) -> Group | None:
        """The narrowest, least-loaded group with room for ``r``; ``imminent``: binding groups only if hard
        (they form at the members' next step boundary, a sequential one waits for their DP work)."""
        fits = [
            g
            for g in self.groups.values()
            if g.state in states
            and not (imminent and g.state == "binding" and g.preempt != "hard")
            and g.width >= width
            and (reasons is None or g.reason in reasons)
            and not self.avoid(r, g.members)
            and self.group_room(g, r)
        ]
        # a bound group serves now; a binding one once its members reach a step boundary (one long DP step, maybe)
        return min(fits, key=lambda g: (g.width, g.state != "bound", self.group_n(g), g.epoch), default=None)

    def avoid(self, r: QueuedRequest, engines: tuple[int, ...]) -> bool:
        """The request failed on one of ``engines`` (it died before answering, its heartbeat may not have expired
        yet): send it elsewhere, unless that engine is the only live one."""
        return r.failed_on in engines and len(self.live) > 1

    def to_group(self, g: Group, r: QueuedRequest) -> None:
        n, kv = self.tp.get(g.epoch, (0, 0))
        self.tp[g.epoch] = (n + 1, kv + r.kv_tokens)
        if g.state == "bound":
            leader = self.live[g.leader]
            self.out.dispatches.append(Dispatch(r, leader.engine, leader.url, g.epoch))
            self.put(_replace(g, last_used=self.now))

    def to_dp(self, r: QueuedRequest) -> bool:
        taken = self.in_groups()
        fits = [
            e
            for e in self.s.engines
            if e.mode == "dp"
            and not e.pending
            and e.engine not in taken
            and not self.avoid(r, (e.engine,))
            and self.dp_inflight[e.engine] < self.cfg.max_inflight_per_worker
            and e.max_total_tokens >= r.kv_tokens
        ]
        if not fits:
            return False
        best, rule = self.pick_dp(r, fits)
        self.sent.setdefault(best.engine, set()).update(r.chain)
        self.dp_inflight[best.engine] += 1
        if self.cfg.spread_s > 0:
            self.recent[best.engine] = self.recent.get(best.engine, 0.0) + 1
        self.dp_kv[best.engine] += r.kv_tokens
        self.out.dispatches.append(Dispatch(r, best.engine, best.url, rule=rule))
        return True

    def pick_dp(self, r: QueuedRequest, fits: list[EngineView]) -> tuple[EngineView, DpRule]:
        """Cache-aware (SGLang's model gateway's rule): the engine holding the longest prefix of ``r``'s chain, the
        least loaded of those, when it holds at least ``cache_threshold`` of the chain's blocks and the
        candidates' loads are balanced (not both more than ``balance_abs_threshold`` apart and the highest above
        ``balance_rel_threshold`` times the lowest); otherwise, and for a request without a chain, least loaded."""
        least = min(fits, key=self.dp_key)
        chain = r.chain
        if self.cfg.dispatch != "cache-aware":
            return least, "least-loaded"
        if not chain:
            return least, "no-chain"
        if self.imbalanced(fits):
            return least, "imbalanced"
        held = {e.engine: self.s.prefixes.match(e.engine, chain, self.sent.get(e.engine, ())) for e in fits}
        top = max(held.values())
        if top == 0 or top < self.cfg.cache_threshold * len(chain):
            return least, "no-match"
        return min((e for e in fits if held[e.engine] == top), key=self.dp_key), "prefix"

    def imbalanced(self, fits: list[EngineView]) -> bool:
        loads = [self.dp_score(e.engine) for e in fits]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo

    def dp_key(self, e: EngineView) -> tuple[float, int, int]:
        return self.dp_score(e.engine), -e.free_kv_tokens, e.engine

    def dp_score(self, e: int) -> float:
        """Least loaded first: requests in flight, those sent within about ``spread_s`` counted twice (their
        prefill is still ahead). Without it an engine that has just become free (a released group's member, whose
        TP requests its leader owns) takes every new request until its count catches up, all of them prefilling
        at once while the other engines only decode."""
        return self.dp_inflight[e] + self.recent.get(e, 0.0)

    def load_binds(self) -> None:
        """Light load: blocks bind one after another. A block whose engines are idle binds at once; a busy one binds
        at once by adoption where its members transform KV and the transformation is cheap (``adopt_max_ms``),
        otherwise it drains first (sequential: its engines get no new work while the rest of the cluster takes it),
        so no request is paused or recomputed. At most half of the blocks still in DP drain at the same time."""
        if self.out.state.busy or not self.cfg.load_adaptation:
            return
        if any(need_width(r.kv_tokens, self.s.engines) not in (1, None) for r in self.s.waiting):
            return  # a long request waits for engines: leave them to it
        sets = self.free_sets(self.cfg.light_width)
        draining = sum(1 for g in self.groups.values() if g.reason == "load" and g.state == "binding")
        in_dp = len(sets) + draining
        for ms in sets:  # least loaded first
            if not self.block_load(ms):
                self.bind(ms, "load", "hard")
            elif self.can_transform(ms) and self.block_load(ms) > self.adopt_fits(ms):
                continue  # it serves its backlog in DP (new work goes to the groups) and adopts once it fits
            elif self.may_adopt(ms):
                self.bind(ms, "load", "hard", adopt=True)
            elif 2 * (draining + 1) <= in_dp:  # no KV transformation, or one too costly: drain
                self.bind(ms, "load", "sequential")
                draining += 1

    def adopt_fits(self, ms: tuple[int, ...]) -> float:
        """The most DP requests a block adopts (``adopt_max_inflight`` per member). A block holding more serves
        them in DP while new work goes to the groups."""
        return self.cfg.adopt_max_inflight * len(ms)

    def block_load(self, ms: tuple[int, ...]) -> int:
        return sum(self.dp_inflight[m] for m in ms)

    def place(self, r: QueuedRequest) -> None:
        width = need_width(r.kv_tokens, self.s.engines)
        if width is None:
            return  # no group can hold it now (the gateway rejects such requests while engines are up)
        if width > 1:
            self.place_long(r, width)
        elif r.priority == "high" and self.cfg.priority and self.place_priority(r):
            pass
        elif (
            not self.out.state.busy and (g := self.group_for(r, 1, USABLE, SHORT, imminent=True)) is not None
        ):
            self.to_group(g, r)
        elif not self.to_dp(r) and (g := self.group_for(r, 1, ("bound",), reasons=("manual",))) is not None:
            self.to_group(g, r)  # an operator bound the engines: traffic still flows through their groups

    def fast_targets(self) -> list[FastTarget]:
        """Where ``place`` would send a short normal request arriving after this round: the light load's group,
        or the DP engines with a free slot (the admission script picks the least loaded). None while a group
        forms (requests wait for it) or when a round would bind or choose among groups for it."""
        probe = QueuedRequest(id="", priority="normal", model="", prompt_tokens=1, max_tokens=1, gateway="", enqueued_at=self.now)  # fmt: skip
        if self.forming() or not self.live:
            return []
        if (
            not self.out.state.busy
            and (g := self.group_for(probe, 1, USABLE, SHORT, imminent=True)) is not None
        ):
            if g.state != "bound" or g.leader not in self.live:
                return []
            n, kv = self.tp.get(g.epoch, (0, 0))
            full = g.width * min(self.live[m].max_total_tokens for m in g.members)
            pooled = g.kv_cap if g.kv_cap and self.other_work(g) > 0 else full
            room = g.width * self.cfg.tp_inflight_per_engine - n
            leader = self.live[g.leader]
            sent = sum(1 for x in self.out.dispatches if x.engine == leader.engine)
            return [FastTarget(engine=leader.engine, url=leader.url, epoch=g.epoch, cap=leader.inflight + sent + room, max_kv=pooled - kv)]  # fmt: skip
        taken = self.in_groups()
        affinity = self.cfg.dispatch == "cache-aware"  # requests with a prefix chain wait for a round
        return [
            FastTarget(
                engine=e.engine,
                url=e.url,
                cap=self.cfg.max_inflight_per_worker,
                max_kv=e.max_total_tokens,
                affinity=affinity,
            )
            for e in self.s.engines
            if e.mode == "dp" and not e.pending and e.engine not in taken
        ]

    def place_priority(self, r: QueuedRequest) -> bool:
        """A group with room that forms at the members' next step boundary, else a new ``priority_width`` group
        that leaves DP engines for everyone else: under light load the least loaded block (hard: its few DP
        requests pause, at most ``max_defer_s``), otherwise only an idle one (pausing a busy engine's DP work costs
        more than the group saves). A busy block binds by adoption where it may (its DP requests continue in the
        group instead of pausing). Else False: the request jumps the queue in DP (classes dispatch first)."""
        if (g := self.group_for(r, 1, USABLE, SHORT, imminent=True)) is not None:
            self.to_group(g, r)
            return True
        if self.reuse_idle(r, 1, ("long",), "priority"):
            return True  # (an idle long group is kept while a high-priority request waits: it must take it)
        taken = self.in_groups()
        dp = {e.engine for e in self.s.engines if e.mode == "dp" and e.engine not in taken}
        light = not self.out.state.busy
        for ms in self.free_sets(self.cfg.priority_width):
            if dp - set(ms) and (light or not self.block_load(ms)):
                adopt = False
                if self.block_load(ms) and self.can_transform(ms):
                    if self.block_load(ms) > self.adopt_fits(ms) or not self.may_adopt(ms):
                        break  # a backlog: it would run in TP at lower throughput (the least loaded block first)
                    adopt = True
                self.bind(ms, "priority", self.cfg.priority_preempt, adopt=adopt)
                return True  # it waits for the group (the next round finds it binding)
        return False

    def place_long(self, r: QueuedRequest, width: int) -> None:
        """The narrowest long (or manual) group that holds it, bound or binding, or an idle load/priority group
        (never one with paused DP work: its release would wait for this request); else bind one (hard only where
        the members' free KV holds it). Under pressure it waits up to ``long_wait_s`` first, so a burst drains in
        DP."""
        cfg = self.cfg
        if (g := self.group_for(r, width, USABLE, ("long", "manual"))) is not None:
            self.to_group(g, r)  # bound: dispatched; binding: it waits for this group
            return
        if self.reuse_idle(r, width, ("load", "priority"), "long"):
            return
        if not cfg.long_context or (self.pressure and self.now - r.enqueued_at < cfg.long_wait_s):
            return
        in_long = sum(g.width for g in self.groups.values() if g.reason == "long") + sum(
            g.width for g in self.out.binds if g.reason == "long"
        )
        if in_long and in_long + width > cfg.long_max_share * len(self.live):
            return  # long groups already hold their share (one is always allowed): the rest stays DP
        if sets := self.free_sets(width):
            preempt, adopt = cfg.long_preempt, False
            if preempt == "hard" and r.kv_tokens > self.hard_cap(sets[0]):
                preempt = "sequential"  # the members' paused DP work would hold KV the request needs
            elif preempt == "hard" and self.block_load(sets[0]):
                adopt = self.may_adopt(sets[0])  # their DP work continues in the group instead of pausing
            self.bind(sets[0], "long", preempt, adopt=adopt)
        else:
            self.release_idle_blocking(width)

    def reuse_idle(
        self, r: QueuedRequest, width: int, reasons: tuple[GroupReason, ...], reason: GroupReason
    ) -> bool:
        """Send ``r`` to a bound group of ``reasons`` that is idle (no TP work, no paused DP work) and holds it,
        the narrowest; the group becomes a ``reason`` group (reused: no release and re-bind)."""
        idle = [
            g
            for g in self.groups.values()
            if g.state == "bound"
            and g.reason in reasons
            and not self.group_n(g)
            and not self.paused_dp(g)
            and g.width >= width
            and not self.avoid(r, g.members)
            and self.group_room(g, r)
        ]
        if not idle:
            return False
        g = min(idle, key=lambda g: (g.width, g.epoch))
        self.put(_replace(g, reason=reason))
        self.to_group(self.groups[g.epoch], r)
        return True

    def release_idle_blocking(self, width: int) -> None:
        """A long request needs ``width`` engines but groups occupy every block: release the idle ones in one."""
        n = max((e.num_engines for e in self.s.engines), default=1)
        for ms in merge_sets(n, (width,)) if 1 < width <= n else []:
            inside = [g for g in self.groups.values() if set(g.members) & set(ms)]
            if all(
                g.state == "bound" and g.reason != "manual" and not self.group_n(g) for g in inside
            ) and all(m in self.live for m in ms):
                for g in inside:
                    self.release(g, ReleaseCause.MAKING_ROOM, width=width)
                return


def decide(s: Snapshot, cfg: PolicyConfig) -> Decision:
    """One policy round: reconcile group records, update the load regime, release, bind, dispatch."""
    rnd = _Round(s, cfg)
    rnd.reconcile()
    rnd.update_regime()
    rnd.out.state = msgspec.structs.replace(rnd.out.state, suspect=rnd.suspect)
    rnd.releases()
    high = [r for r in s.waiting if r.priority == "high"]  # before load binds take the engines
    for r in high:
        rnd.place(r)
    rnd.load_binds()
    for r in s.waiting:
        if r.priority != "high":
            rnd.place(r)
    rnd.out.state = msgspec.structs.replace(rnd.out.state, recent=rnd.recent)
    rnd.out.fast = [] if rnd.out.binds or rnd.out.commands else rnd.fast_targets()  # a switch: the next round
    return rnd.out
